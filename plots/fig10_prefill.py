"""Figure 10's prefill side: each system's prefill tokens/s at each (length, batch) point of real prefills
(`+experiment=fig10_prefill`), one bar a system, a point's refusals ("OOM", "RAM") written where their bar would
be. Reads run records as plots.fig10_throughput does (one device budget a figure).

    python -m plots.fig10_prefill results/fig10_prefill --out fig10_prefill --allow-mixed-commits
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from plots import fig10_throughput  # noqa: E402
from plots.markdown import md, source  # noqa: E402
from plots.records import SYSTEMS, cli, commit_of, plot_arguments, save, tokens  # noqa: E402


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


def table(root: Path, folder: str) -> str:
    """Prefill seconds and tokens/s of every system per point, against FullAttn's at the same point when FullAttn
    ran in the same sweep (same commit and card; "OOM": the preflight refused it), with each run's device peak
    against its plan. The folder may hold points of several commits and cards: each row names its own."""
    d = fig10_throughput.data(root, allow_mixed=True)
    pts, refused, _ = fig10_throughput.by_point(d)
    recs = {r["file"]: r["record"] for r in d["records"]}
    where = {f: (commit_of(rec), rec["environment"].get("gpu")) for f, rec in recs.items()}
    rows = []
    for n, b, s in sorted(
        {(n, b, s) for s, n, b in (*pts, *refused)}, key=lambda k: (k[0], k[1], list(SYSTEMS).index(k[2]))
    ):
        if (s, n, b) not in pts:
            rows.append([tokens(n), b, SYSTEMS[s], refused[(s, n, b)], None, None, None, None, None])
            continue
        p, full = pts[(s, n, b)], pts.get(("fullattn", n, b))
        m, plan = p["metrics"], recs[p["file"]]["memory_plan_gb"]
        same = full is not None and where[full["file"]] == where[p["file"]]
        x = f"{m['prefill_tokens_per_s'] / full['metrics']['prefill_tokens_per_s']:.2f}" if same else None
        peak = f"{m['peak_device_gb']:.2f} ({plan['weights'] + plan['activations'] + plan['kv_device']:.2f})"
        rows.append(
            [
                tokens(n),
                b,
                SYSTEMS[s],
                f"{m['prefill_s']:.2f}",
                f"{m['prefill_tokens_per_s']:,.0f}",
                x,
                peak,
                *where[p["file"]],
            ]
        )
    head = ["seqlen", "batch", "system", "prefill s", "tokens/s", "x FullAttn", "peak GB (plan)", "commit", "GPU"]
    return (
        md(head, rows)
        + f"\n\nDevice budget {d['budget_gb']:g} GB (hardware.gpu_mem_gb). "
        + source(folder, d["records"])
    )


def main() -> None:
    args = plot_arguments(__doc__, mixed=True).parse_args()
    d = plot(args.root, args.out, args.allow_mixed_commits)
    print(f"{len(d['records'].rows)} runs, {len(d['refused'])} refused -> {args.out}")


if __name__ == "__main__":
    cli(main)
