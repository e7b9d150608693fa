"""The speed-fidelity frontier: each system a curve over its top-k budgets, x its decode throughput from GPU records
(experiments.run at Llama-3-8B shapes, synthetic weights and the fitted query process, one sequence length and batch),
y its top-1 agreement with exact attention from CPU fidelity records (experiments.fidelity, real SmolLM2 weights).
The two axes come from different models: no GPU machine here holds a real checkpoint, and no CPU decodes at
Llama-3-8B's size. What joins them is the algorithm: a point pairs the two records of one system with the same
settings (top-k budget, window, retriever, thresholds...), and tests/test_fidelity_gpu.py checks that a system's
GPU path gives the fidelity of its CPU path. A pair whose settings differ is refused, naming the setting.

    python -m plots.fidelity_frontier results/fidelity/2k results/fidelity_frontier/128k_b1 --out frontier_2k
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from plots import fidelity  # noqa: E402
from plots.markdown import f1, md  # noqa: E402
from plots.records import SYSTEMS, RecordError, cli, load_records, save, tokens  # noqa: E402

# the settings that decide what a system attends; the others say where and how fast (transfer path, threads,
# kernels, plan measurements) or are the model's own (hash weights, head importance, reuse profile, skew)
ALGORITHM = (
    "topk_ratio", "sink", "recent", "dense_layers", "retriever", "rbit", "eta", "n", "adaptive_threshold",
    "gqa_aggregation", "threshold_override", "persistent", "speculative", "persist_query", "block_size", "selection",
    "cache_multiple", "channel_fraction", "oracle_query", "cache_tokens", "admit_blocks",
)  # fmt: skip


def settings(rec: dict) -> dict:
    system = rec["config"]["system"]
    return {k: system[k] for k in ALGORITHM if k in system}


def gpu_points(root: Path) -> dict[tuple[str, float], dict]:
    """(system, top-k ratio) -> its GPU record (ok runs; the fastest where a point ran twice)."""
    out: dict[tuple[str, float], dict] = {}
    for r in load_records(root, allow_mixed=True):
        rec = r["record"]
        key = (rec["system"], settings(rec).get("topk_ratio"))
        if key not in out or _tps(rec) > _tps(out[key]):
            out[key] = rec
    return out


def _tps(rec: dict) -> float:
    return rec["metrics"]["decode_tokens_per_s"]


def pairs(fidelity_root: Path, gpu_root: Path) -> list[tuple[dict, dict]]:
    """(fidelity record, GPU record) of each system and budget both have, their settings checked equal."""
    gpu = gpu_points(gpu_root)
    out = []
    for rec in fidelity.load(fidelity_root):
        cpu = rec["record"]
        mine = settings(cpu)
        other = gpu.get((cpu["system"], mine.get("topk_ratio")))
        if other is None:
            continue
        theirs = settings(other)
        for k in sorted(mine.keys() & theirs.keys()):
            if mine[k] != theirs[k]:
                raise RecordError(
                    f"{cpu['label']} at top-k {mine.get('topk_ratio')}: the fidelity record has {k}={mine[k]!r}, "
                    f"the GPU record {k}={theirs[k]!r}; a frontier point needs one setting"
                )
        out.append((cpu, other))
    if not out:
        raise RecordError(
            f"no system and top-k budget has both a fidelity record under {fidelity_root} and a GPU "
            f"record under {gpu_root}"
        )
    return out


def plot(fidelity_root: Path, gpu_root: Path, out: Path) -> list[tuple[dict, dict]]:
    matched = pairs(fidelity_root, gpu_root)
    fig, ax = plt.subplots(figsize=(6, 4.2))
    curves: dict[str, dict[float, tuple[float, dict, float]]] = {}  # label -> budget -> point (one per budget)
    for cpu, gpu in matched:
        ratio = settings(cpu)["topk_ratio"]
        label = cpu["label"].replace(f" system.topk_ratio={ratio}", "")
        curves.setdefault(label, {})[ratio] = (ratio, cpu["summary"]["top1"], _tps(gpu))
    for i, (label, by_ratio) in enumerate(sorted(curves.items())):
        pts = [by_ratio[r] for r in sorted(by_ratio)]
        name = SYSTEMS.get(label, label)
        ax.errorbar(
            [p[2] for p in pts],
            [p[1]["mean"] * 100 for p in pts],
            yerr=[
                [(p[1]["mean"] - p[1]["low"]) * 100 for p in pts],
                [(p[1]["high"] - p[1]["mean"]) * 100 for p in pts],
            ],
            fmt="o-",
            color=f"C{i}",
            label=name,
            capsize=2,
        )
        for ratio, top1, tps in pts:
            ax.annotate(
                f"{ratio * 100:g}%", (tps, top1["mean"] * 100), fontsize=6, xytext=(3, 3), textcoords="offset points"
            )
    cpu0, gpu0 = matched[0]
    ax.set_xlabel(f"decode tokens/s, {gpu0['model']} shapes, {tokens(gpu0['seqlen'])} BSZ {gpu0['batch']} (GPU)")
    ax.set_ylabel(f"top-1 agreement with exact attention, % ({cpu0['model']}, CPU)")
    ax.set_title(
        f"Speed vs fidelity: throughput from {gpu0['model']} shapes on a GPU, fidelity from {cpu0['model']} on "
        f"{tokens(cpu0['workload']['length'])} documents\n(two models: the pairs share each system's settings)",
        fontsize=8,
    )
    ax.legend(fontsize=7)
    save(fig, out)
    return matched


def plot_results(gpu_root: Path, out: Path, cpu: str) -> list[tuple[dict, dict]]:
    """plots.all's form: the GPU records' folder, the CPU records' folder relative to the results folder above it
    (results/fidelity_frontier/<point>/ and results/<cpu>)."""
    return plot(Path(gpu_root).parents[1] / cpu, gpu_root, out)


def table(gpu_root: Path, folder: str, cpu: str = "fidelity/2k") -> str:
    matched = pairs(gpu_root.parents[1] / cpu, gpu_root)
    rows = [
        [c["label"], settings(c)["topk_ratio"], f1(c["summary"]["top1"]["mean"] * 100),
         f1(g["metrics"]["decode_tokens_per_s"])]
        for c, g in matched
    ]  # fmt: skip
    return md(["run", "top-k", "top-1 agreement % (CPU)", "decode tokens/s (GPU)"], rows)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fidelity_root", type=Path)
    ap.add_argument("gpu_root", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    for cpu, gpu in plot(args.fidelity_root, args.gpu_root, args.out):
        print(f"{cpu['label']:<40} top-1 {cpu['summary']['top1']['mean'] * 100:6.2f} %  {_tps(gpu):9.1f} tokens/s")


if __name__ == "__main__":
    cli(main)
