"""Fidelity against exact attention, from `python -m experiments.fidelity` records: per run and length, the mean KL
from exact attention's next-token distribution, top-1 agreement and the true token's log-likelihood against exact
attention's, each with its 95 % bootstrap interval over documents; and paired differences against CLO's default run
(the same documents and tokens, so most of the documents' own variation cancels). The figure puts each run at (KL,
top-1 agreement), one panel per length. Its README's tables and findings are generated blocks (plots.readmes).

    python -m plots.fidelity results/fidelity --out results/figures/fidelity
"""

from __future__ import annotations

from itertools import cycle
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from plots import fig10_throughput  # noqa: E402
from plots.bootstrap import paired  # noqa: E402
from plots.fidelity_findings import at_default_budget, findings, per_doc  # noqa: E402
from plots.markdown import source  # noqa: E402
from plots.records import Records, cli, load_files, plot_arguments, save, tokens  # noqa: E402

BASE = "clo"  # the run the paired differences are taken against: CLO at its defaults
ORDER = ("fullattn", "clo", "retroinfer", "infinigen", "pqcache")


def is_fidelity(rec: dict) -> bool:
    return rec.get("status") == "ok" and isinstance(rec.get("per_document"), list)


def load(root: Path) -> Records:
    return load_files(root, "record.json", is_fidelity, "fidelity records", allow_mixed=True)


def by_length(recs: Records) -> dict[int, list[dict]]:
    """length -> that length's records, FullAttn and CLO first, then the other systems, then variants."""
    out: dict[int, list[dict]] = {}
    for r in recs:
        out.setdefault(r["record"]["workload"]["length"], []).append(r["record"])

    def rank(rec: dict):
        name = rec["label"].split(" ")[0]
        return (ORDER.index(name) if name in ORDER else len(ORDER), rec["label"] != name, rec["label"])

    return {n: sorted(v, key=rank) for n, v in sorted(out.items())}


def _ci(s: dict, scale: float = 1.0, digits: int = 4) -> str:
    def show(x: float) -> str:
        return f"{round(x * scale, digits) + 0.0:.{digits}f}"  # + 0.0: a rounding to -0 shows as 0

    return f"{show(s['mean'])} [{show(s['low'])}, {show(s['high'])}]"


def runs_table(records: list[dict]) -> str:
    rows = [
        "| run | documents | KL (nats/token) | top-1 agreement % | Δ log-likelihood (nats/token) | top-k recall | "
        "attention mass | hit rate | host→device KB/step | commit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rec in records:
        s, hit = rec["summary"], rec.get("hit_rate")
        probed = " | ".join(_ci(s[m], 1, 3) if m in s else "–" for m in ("recall", "mass"))
        rows.append(
            f"| {rec['label']} | {len(rec['per_document'])} | {_ci(s['kl'])} | {_ci(s['top1'], 100, 2)} | "
            f"{_ci(s['dll'])} | {probed} | {'–' if hit is None else f'{hit:.3f}'} | "
            f"{rec['bytes_h2d_per_step'] / 1e3:.1f} | {rec['environment']['git']['commit'][:7]} |"
        )
    return "\n".join(rows)


def paired_table(records: list[dict], base: str = BASE) -> str | None:
    """Each run minus the base run, on the documents both scored; None without a base run."""
    ref = next((r for r in records if r["label"] == base), None)
    if ref is None:
        return None
    rows = [
        f"| run − {base} | shared documents | Δ top-1 agreement (points) | Δ KL (nats/token) |",
        "|---|---|---|---|",
    ]
    for rec in records:
        if rec is ref:
            continue
        top1 = paired(per_doc(rec, "top1"), per_doc(ref, "top1"))
        kl = paired(per_doc(rec, "kl"), per_doc(ref, "kl"))
        if top1 is None:
            continue
        shared = len(per_doc(rec, "top1").keys() & per_doc(ref, "top1").keys())
        rows.append(
            f"| {rec['label']} | {shared} | {_ci(dict(zip(('mean', 'low', 'high'), top1)), 100, 2)} | "
            f"{_ci(dict(zip(('mean', 'low', 'high'), kl)))} |"
        )
    return "\n".join(rows)


VARIANT_MARKERS = "^v<>DPX*hpd"  # a system's runs with other settings, in the order the records list them


def styles(records: list[dict]) -> list[dict]:
    """Each run's colour (its system's, as in every figure) and marker: a filled circle at the system's own settings
    (a matched budget, or kv_dtype=model, included), an open square with FP8 host rows, another marker per variant."""
    out, variants = [], cycle(VARIANT_MARKERS)
    for rec in records:
        system, *overrides = rec["label"].split(" ")
        style = {"color": fig10_throughput.colour(system), "fmt": "o"}
        if overrides == ["kv_dtype=fp8"]:
            style.update(fmt="s", mfc="white")
        elif overrides and overrides != ["kv_dtype=model"] and not at_default_budget(rec["label"]):
            style["fmt"] = next(variants)
        out.append(style)
    return out


def plot(root: Path, out: Path) -> Records:
    recs = load(root)
    lengths = by_length(recs)
    fig, axes = plt.subplots(1, len(lengths), figsize=(7.5 * len(lengths), 4.2), squeeze=False)
    for ax, (length, records) in zip(axes[0], lengths.items()):
        drawn = [r for r in records if r["summary"]["kl"]["mean"] > 0]
        for rec, style in zip(drawn, styles(drawn)):
            kl, top1 = rec["summary"]["kl"], rec["summary"]["top1"]
            ax.errorbar(
                kl["mean"],
                top1["mean"] * 100,
                xerr=[[kl["mean"] - kl["low"]], [kl["high"] - kl["mean"]]],
                yerr=[[(top1["mean"] - top1["low"]) * 100], [(top1["high"] - top1["mean"]) * 100]],
                label=rec["label"],
                capsize=2,
                **style,
            )
        ax.set_xscale("log")
        ax.set_xlabel("KL from exact attention (nats/token, log scale)")
        ax.set_ylabel("top-1 agreement with exact attention (%)")
        ax.set_title(f"{tokens(length)} documents, 95 % intervals over documents", fontsize=9)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)  # beside: no point hidden
    fig.suptitle(
        "Fidelity against exact attention, SmolLM2-135M (FullAttn: KL 0, top-1 100 %)",
        fontsize=9,
    )
    save(fig, out)
    return recs


def tables(root: Path) -> str:
    parts = []
    for length, records in by_length(load(root)).items():
        parts += [f"\n## {tokens(length)} documents\n", runs_table(records)]
        pt = paired_table(records)
        if pt:
            parts += ["\nPaired against CLO's default run:\n", pt]
    return "\n".join(parts)


def blocks(root: Path) -> dict[str, str]:
    """results/fidelity/README.md's generated blocks (plots.readmes): the tables, and the findings per length."""
    found = []
    for length, records in by_length(load(root)).items():
        if said := findings(records):  # a length without CLO at its defaults has nothing to compare with
            found += [f"At {tokens(length)}:", "", *(f"- {x}" for x in said), ""]
    return {"tables": tables(root).strip("\n"), "findings": "\n".join(found)}


def table(root: Path, folder: str) -> str:
    """Per length, every run's distance from exact attention and the paired differences against CLO (the paper
    reports none: its Table 5 is task accuracy)."""
    return tables(root) + "\n\n" + source(folder, load(root))


def main() -> None:
    args = plot_arguments(__doc__).parse_args()
    plot(args.root, args.out)


if __name__ == "__main__":
    cli(main)
