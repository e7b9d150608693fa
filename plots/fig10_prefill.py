"""Figure 10's prefill side: each system's prefill tokens/s at each (length, batch) point of real prefills
(`+experiment=fig10_prefill`), one bar a system, a point's refusals ("OOM", "RAM") written where their bar would
be. Reads run records as plots.fig10_throughput does (one device budget a figure).

    python -m plots.fig10_prefill results/fig10_prefill --out fig10_prefill --allow-mixed-commits
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from plots import fig10_throughput  # noqa: E402
from plots.records import SYSTEMS, cli, plot_arguments, save, tokens  # noqa: E402


def plot(root, out, allow_mixed: bool = False) -> dict:
    d = fig10_throughput.data(root, allow_mixed)
    pts, refused, shown = fig10_throughput.by_point(d)
    points = sorted({(n, b) for _, n, b in (*pts, *refused)})
    width = 0.8 / len(shown)
    fig, ax = plt.subplots(figsize=(1.4 * len(points) + 2, 4))
    for i, s in enumerate(shown):
        xs = [j + (i - (len(shown) - 1) / 2) * width for j in range(len(points))]
        ys = [(pts.get((s, n, b)) or {}).get("prefill_tokens_per_s") or 0 for n, b in points]
        colour = fig10_throughput.colour(s)
        ax.bar(xs, ys, width, color=colour, label=SYSTEMS[s])
        for x, (n, b) in zip(xs, points):
            if (s, n, b) in refused:
                ax.text(x, 0, refused[(s, n, b)], rotation=90, ha="center", va="bottom", fontsize=7, color=colour)
    cards = {(r["record"]["seqlen"], r["record"]["batch"]): card(r["record"]) for r in d["records"]}
    mixed = len(set(cards.values())) > 1  # a point's card under its label, where the folder has several
    ax.set_xticks(
        range(len(points)),
        [f"{tokens(n)}\nBSZ {b}" + (f"\n{cards.get((n, b), '')}" if mixed else "") for n, b in points],
    )
    ax.set_ylabel("prefill tokens/s")
    ax.legend(fontsize=7)
    budget = fig10_throughput.budget_text(d["budget_gb"])
    ax.set_title(f"Prefill throughput: {d['model']}, {budget}", fontsize=9)
    save(fig, out)
    return d


def card(rec: dict) -> str:
    """A record's GPU in short: 'NVIDIA H100 80GB HBM3' -> 'H100'."""
    name = rec["environment"].get("gpu") or "?"
    return next((w for w in name.split() if w[:1] in "ABHL" and w[1:].isdigit()), name)


def main() -> None:
    args = plot_arguments(__doc__, mixed=True).parse_args()
    d = plot(args.root, args.out, args.allow_mixed_commits)
    print(f"{len(d['records'].rows)} runs, {len(d['refused'])} refused -> {args.out}")


if __name__ == "__main__":
    cli(main)
