"""The +T/+G/+P ablation of CLO (`+ablation=base,t,tg,tgp`): one bar per variant. On a GPU, latency as % of the
base variant with the paper's reductions (hatched) beside ours; always the cache hit rate and the bytes moved
host -> device per step. A CPU run's latency says nothing about the paper's, so it is not drawn. The variant
is read from the record's switches (conf/ablation/*.yaml), not from its name.

    python -m plots.ablation results/ablation_gpu_128k --out ablation.png
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from plots import paper  # noqa: E402
from plots.markdown import f1, md, source  # noqa: E402
from plots.records import RecordError, cli, load_records, names, one_value, plot_arguments, save, tokens  # noqa: E402

# (adaptive_threshold, gqa_aggregation, persistent) of conf/ablation/*.yaml
VARIANTS = {
    (False, "min", False): "base",
    (True, "min", False): "t",
    (True, "mean", False): "tg",
    (True, "mean", True): "tgp",
}
LABELS = {"base": "base", "t": "+ T", "tg": "+ T + G", "tgp": "+ T + G + P"}


def variant(rec: dict) -> str | None:
    s = rec["config"]["system"]
    return VARIANTS.get((s.get("adaptive_threshold"), s.get("gqa_aggregation"), s.get("persistent")))


def data(root: Path) -> dict:
    """{"variants": {name: {"ms_per_step", "vs_base_percent", "hit_rate", "mb_per_step", "persistent_heads",
    "prefetch_heads", "file"}}, "device", "model", "seqlen", "records"}."""
    recs = load_records(root)
    not_clo = [r["file"] for r in recs if r["record"]["system"] != "clo"]
    if not_clo:
        raise RecordError(f"the ablation is CLO's; not CLO: {names(not_clo)} under {root}")
    other = [r["file"] for r in recs if variant(r["record"]) is None]
    if other:
        raise RecordError(f"not one of the ablation's variants ({', '.join(VARIANTS.values())}): {names(other)}")
    by: dict[str, dict] = {}
    for r in recs:
        v = variant(r["record"])
        if v in by:
            raise RecordError(f"two records of variant {v} under {root}: {by[v]['file']}, {r['file']}")
        by[v] = r
    if "base" not in by:
        raise RecordError(f"no base variant under {root}: the reductions are against it")
    out = {}
    for v in (v for v in VARIANTS.values() if v in by):
        rec = by[v]["record"]
        m, plan = rec["metrics"], rec.get("system_state", {}).get("plan", {})
        out[v] = {
            "ms_per_step": m["decode_ms_per_step"],
            "hit_rate": m.get("hit_rate"),
            "mb_per_step": m["bytes_h2d_per_step"] / 1e6,
            "persistent_heads": plan.get("persistent_heads"),
            "prefetch_heads": plan.get("prefetch_heads"),
            "file": by[v]["file"],
        }
    base = out["base"]["ms_per_step"]
    for row in out.values():
        row["vs_base_percent"] = (row["ms_per_step"] / base - 1) * 100
    return {
        "variants": out,
        "device": one_value(recs, lambda r: r["environment"]["device"], "devices"),
        "model": one_value(recs, lambda r: r["model"], "models"),
        "seqlen": one_value(recs, lambda r: r["seqlen"], "sequence lengths"),
        "records": recs,
    }


def plot(root: Path, out: Path) -> dict:
    d = data(root)
    rows, gpu = d["variants"], d["device"] == "cuda"
    names_ = list(rows)
    x = list(range(len(names_)))
    fig, axes = plt.subplots(1, 3 if gpu else 2, figsize=(11 if gpu else 7.5, 3.8))
    if gpu:
        ax = axes[0]
        ours = [100 + rows[v]["vs_base_percent"] for v in names_]
        ax.bar([i - 0.2 for i in x], ours, width=0.4, label=f"ours ({d['model']} {tokens(d['seqlen'])})")
        ref = [(i, 100 - paper.ABLATION_REDUCTION_PERCENT.get(v, 0)) for i, v in enumerate(names_)]
        ax.bar([i + 0.2 for i, _ in ref], [v for _, v in ref], width=0.4, fill=False, hatch="//", label=paper.ABLATION)
        for i, v in enumerate(names_):
            if v != "base":
                text = {"ha": "center", "va": "bottom", "fontsize": 7, "rotation": 90}
                ax.text(i - 0.2, ours[i] + 1, f"{rows[v]['vs_base_percent']:+.1f}%", **text)
                ax.text(i + 0.2, ref[i][1] + 1, f"-{paper.ABLATION_REDUCTION_PERCENT[v]}%", **text)
        ax.set_ylim(0, 125)
        ax.set_ylabel("decode latency, % of base")
        ax.legend(fontsize=7)
    for ax, key, label in zip(
        axes[1:] if gpu else axes, ("hit_rate", "mb_per_step"), ("hit rate (cached heads)", "MB host -> device / step")
    ):
        vals = [rows[v][key] * (100 if key == "hit_rate" else 1) for v in names_]
        ax.bar(x, vals, width=0.5)
        ax.set_ylabel(label + (" %" if key == "hit_rate" else ""))
    for ax in axes:
        ax.set_xticks(x, [LABELS[v] for v in names_], fontsize=8)
    fig.suptitle(
        f"The +T/+G/+P ablation: {d['model']} {tokens(d['seqlen'])} on {d['device']}"
        + ("" if gpu else " (CPU: latency not drawn)"),
        fontsize=9,
    )
    save(fig, out)
    return rows


def table(root: Path, folder: str) -> str:
    d = data(root)
    gpu = d["device"] == "cuda"
    rows = []
    for v, r in d["variants"].items():
        ref = paper.ABLATION_REDUCTION_PERCENT.get(v)
        ours = -r["vs_base_percent"]
        rows.append(
            [
                LABELS[v],
                f"{r['ms_per_step']:.2f}" if gpu else None,
                f1(-ours, "%") if gpu and v != "base" else None,
                f1(-ref, "%") if ref else None,
                f"{ours / ref:.2f}" if gpu and ref else None,
                f1(r["hit_rate"] * 100, "%") if r["hit_rate"] is not None else None,
                f1(r["mb_per_step"]),
            ]
        )
    head = [
        "variant",
        "ms/step",
        "vs base",
        f"{paper.ABLATION}: vs base",
        "ours / paper reduction",
        "hit rate",
        "MB/step host -> device",
    ]
    note = "" if gpu else "\n\nA CPU run: its latency does not stand for the paper's and is not compared."
    return (
        md(head, rows)
        + note
        + f"\n\n{d['model']} {tokens(d['seqlen'])} on {d['device']}. "
        + source(folder, d["records"])
    )


def main() -> None:
    ap = plot_arguments(__doc__)
    args = ap.parse_args()
    for v, row in plot(args.root, args.out).items():
        print(f"{LABELS[v]:<12} {row['ms_per_step']:8.2f} ms/step ({row['vs_base_percent']:+.1f}%)")


if __name__ == "__main__":
    cli(main)
