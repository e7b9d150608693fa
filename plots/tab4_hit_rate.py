"""Paper Table 4: the cache hit rate of CLO and RetroInfer-style, one bar per run (its batch and needle depth),
with the paper's range for each system as a hatched band. Reads run records of `+experiment=tab4_hit_rate`.

    python -m plots.tab4_hit_rate results/tab4_hit_rate --out tab4.png
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from plots import paper  # noqa: E402
from plots.markdown import f1, md, source  # noqa: E402
from plots.records import SYSTEMS, RecordError, cli, load_records, names, one_value, plot_arguments, save, tokens  # noqa: E402

CACHED = ("clo", "retroinfer")  # the systems with a cache


def data(root: Path) -> dict:
    """{"rows": [{"system", "batch", "needle_depth", "hit_rate", "mb_per_step", "file"}], "model", "seqlen",
    "records"}, sorted by system, batch, depth."""
    recs = load_records(root)
    other = [r["file"] for r in recs if r["record"]["system"] not in CACHED]
    if other:
        raise RecordError(f"hit rates are of {' and '.join(CACHED)}; other systems: {names(other)} under {root}")
    no_rate = [r["file"] for r in recs if r["record"]["metrics"].get("hit_rate") is None]
    if no_rate:
        raise RecordError(f"no hit rate in {names(no_rate)} under {root}")
    rows = [
        {
            "system": (rec := r["record"])["system"],
            "batch": rec["batch"],
            "needle_depth": rec["config"]["workload"].get("needle_depth"),
            "hit_rate": rec["metrics"]["hit_rate"],
            "mb_per_step": rec["metrics"]["bytes_h2d_per_step"] / 1e6,
            "file": r["file"],
        }
        for r in recs
    ]
    rows.sort(key=lambda r: (CACHED.index(r["system"]), r["batch"], r["needle_depth"] or 0))
    return {
        "rows": rows,
        "model": one_value(recs, lambda r: r["model"], "models"),
        "seqlen": one_value(recs, lambda r: r["seqlen"], "sequence lengths"),
        "records": recs,
    }


def plot(root: Path, out: Path) -> list[dict]:
    d = data(root)
    rows = d["rows"]
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(rows) + 2), 4))
    x = list(range(len(rows)))
    ax.bar(x, [r["hit_rate"] * 100 for r in rows], color=[f"C{CACHED.index(r['system'])}" for r in rows], width=0.6)
    for i, r in enumerate(rows):
        ax.text(i, r["hit_rate"] * 50, f"{r['hit_rate'] * 100:.1f}%", ha="center", color="white", fontsize=8)
    first = True
    for s in CACHED:
        idx = [i for i, r in enumerate(rows) if r["system"] == s]
        if idx and s in paper.TAB4_HIT_RATE_PERCENT:
            lo, hi = paper.TAB4_HIT_RATE_PERCENT[s]
            ax.fill_between(
                [idx[0] - 0.4, idx[-1] + 0.4],
                lo,
                hi,
                facecolor="none",
                hatch="//",
                edgecolor="black",
                label=f"{paper.TAB4} range" if first else None,
            )
            first = False
    labels = [f"{SYSTEMS[r['system']]}\nb{r['batch']} depth {r['needle_depth']}" for r in rows]
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylim(0, 100)
    ax.set_ylabel("cache hit rate, %")
    ax.set_title(f"Cache hit rate: {d['model']} {tokens(d['seqlen'])}", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    save(fig, out)
    return rows


TAB4_HEAD = paper.TAB4 + ": range"


def table(root: Path, folder: str) -> str:
    d = data(root)
    rows = []
    for r in d["rows"]:
        lo, hi = paper.TAB4_HIT_RATE_PERCENT[r["system"]]
        h = r["hit_rate"] * 100
        rows.append(
            [
                SYSTEMS[r["system"]],
                r["batch"],
                r["needle_depth"],
                f1(h, "%"),
                f"{lo}-{hi}%",
                f"{h / hi:.2f}-{h / lo:.2f}",
                f1(r["mb_per_step"]),
            ]
        )
    head = ["system", "batch", "needle depth", "hit rate", TAB4_HEAD, "ours / paper", "MB/step host -> device"]
    return md(head, rows) + f"\n\n{d['model']} {tokens(d['seqlen'])}. " + source(folder, d["records"])


def main() -> None:
    ap = plot_arguments(__doc__)
    args = ap.parse_args()
    for r in plot(args.root, args.out):
        print(f"{r['system']:<11} b{r['batch']} depth {r['needle_depth']}: {r['hit_rate'] * 100:.1f}%")


if __name__ == "__main__":
    cli(main)
