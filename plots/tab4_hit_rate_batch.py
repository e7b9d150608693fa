"""Paper Table 4 by batch size: the hit rates of CLO and RetroInfer-style against batch, one panel per sequence
length, read from Figure 10's records (the run each point is plotted at there: its fastest). CLO's hit rate is given
with both denominators: over its reuse heads' lookups (a hit reuses the head's whole cached top-k), and over every
non-persistent head, its prefetch heads counted as fetched (they refresh every step by design). Persistent heads
always hit and are in neither. RetroInfer-style's is over its 8-token blocks. The paper's range is drawn at 8K,
where its Table 4 was measured.

    python -m plots.tab4_hit_rate_batch results/fig10_throughput --out tab4_batch --allow-mixed-commits
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from plots import fig10_throughput, paper  # noqa: E402
from plots.markdown import f1, md, source  # noqa: E402
from plots.records import SYSTEMS, NoRecords, RecordError, Records, cli, plot_arguments, read_json, save, tokens  # noqa: E402

PAPER_SEQLEN = 8192  # the length of the paper's Table 4
# (system, metric, label) of each line drawn
SERIES = (
    ("clo", "hit_rate", "CLO, over reuse heads' lookups"),
    ("clo", "hit_rate_with_refreshes", "CLO, over all non-persistent heads"),
    ("retroinfer", "hit_rate", "RetroInfer-style, over 8-token blocks"),
)


def data(root: Path, allow_mixed: bool = False) -> dict:
    """{"rows": [{"seqlen", "batch", "clo": metrics | None, "retroinfer": metrics | None, "plan": CLO's plan}],
    "budget_gb", "model", "importance": CLO's head importance (its thresholds follow it), "records": the runs
    drawn}, one row per (seqlen, batch) where CLO or RetroInfer-style ran."""
    d = fig10_throughput.data(root, allow_mixed)
    pts = d["points"]
    keys = sorted({(n, b) for s, n, b in pts if s in ("clo", "retroinfer")})
    if not keys:
        raise NoRecords(f"no CLO or RetroInfer-style run under {root}")
    rows = []
    for n, b in keys:
        m = {s: pts[(s, n, b)]["metrics"] if (s, n, b) in pts else None for s in ("clo", "retroinfer")}
        missing = [s for s, x in m.items() if x is not None and x.get("hit_rate") is None]
        if missing:
            raise RecordError(f"no hit rate in the {', '.join(missing)} run at {tokens(n)} batch {b} under {root}")
        rows.append({"seqlen": n, "batch": b, **m, "plan": plan_of(pts.get(("clo", n, b)), root)})
    drawn = {pts[(s, n, b)]["file"] for s in ("clo", "retroinfer") for n, b in keys if (s, n, b) in pts}
    recs = Records(d["records"].root, [r for r in d["records"] if r["file"] in drawn])
    importance = {
        (r["record"].get("system_state") or {}).get("importance") for r in recs if r["record"]["system"] == "clo"
    }
    return {
        "rows": rows,
        "budget_gb": d["budget_gb"],
        "model": d["model"],
        "importance": ", ".join(sorted(str(i) for i in importance)),
        "records": recs,
    }


def plan_of(point: dict | None, root: Path) -> dict | None:
    """CLO's head counts at a point: persistent, prefetch and demoted heads (its plan under the budget)."""
    if point is None:
        return None
    rec = read_json(Path(root) / point["file"])
    plan = (rec.get("system_state") or {}).get("plan") or {}
    return {k: plan.get(f"{k}_heads") for k in ("persistent", "prefetch", "demoted")}


def plot(root: Path, out: Path, allow_mixed: bool = False) -> dict:
    d = data(root, allow_mixed)
    seqlens = sorted({r["seqlen"] for r in d["rows"]})
    fig, axes = plt.subplots(1, len(seqlens), figsize=(4 * len(seqlens) + 1, 3.8), squeeze=False)
    for ax, n in zip(axes[0], seqlens):
        rows = [r for r in d["rows"] if r["seqlen"] == n]
        for i, (s, key, label) in enumerate(SERIES):
            pts = [(r["batch"], r[s][key] * 100) for r in rows if r[s] is not None]
            if pts:
                ax.plot(*zip(*pts), "o-" if key == "hit_rate" else "s--", color=f"C{i}", label=label)
        if n == PAPER_SEQLEN:
            for i, s in ((0, "clo"), (2, "retroinfer")):
                lo, hi = paper.TAB4_HIT_RATE_PERCENT[s]
                ax.axhspan(
                    lo, hi, facecolor="none", hatch="//", edgecolor=f"C{i}", lw=0, label=f"{paper.TAB4}: {SYSTEMS[s]}"
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["batch"] for r in rows], [str(r["batch"]) for r in rows])
        ax.set_ylim(0, 100)
        ax.set_title(tokens(n), fontsize=9)
        ax.set_xlabel("batch")
        ax.set_ylabel("cache hit rate, %")
        ax.legend(fontsize=6, loc="lower left")
    budget = fig10_throughput.budget_text(d["budget_gb"])
    fig.suptitle(f"Cache hit rate by batch: {d['model']}, Figure 10's runs, {budget}", fontsize=9)
    save(fig, out)
    return d


def table(root: Path, folder: str) -> str:
    """Hit rates by batch from Figure 10's runs: CLO's over its reuse heads' lookups and over every non-persistent
    head (prefetch heads counted as fetched), its plan's head counts, RetroInfer-style's over blocks, MB moved."""
    d = data(root, allow_mixed=True)
    pct = lambda m, key: f1(m[key] * 100, "%") if m else None
    rows = []
    band = "{}-{}%".format(*paper.TAB4_HIT_RATE_PERCENT["clo"])
    for r in d["rows"]:
        c, ri, plan = r["clo"], r["retroinfer"], r["plan"]
        rows.append(
            [
                tokens(r["seqlen"]),
                r["batch"],
                "/".join("-" if plan[k] is None else str(plan[k]) for k in ("persistent", "prefetch", "demoted"))
                if plan
                else None,
                pct(c, "hit_rate"),
                pct(c, "hit_rate_with_refreshes"),
                f1(c["bytes_h2d_per_step"] / 1e6) if c else None,
                pct(ri, "hit_rate"),
                f1(ri["bytes_h2d_per_step"] / 1e6) if ri else None,
                band if r["seqlen"] == PAPER_SEQLEN else None,
            ]
        )
    head = [
        "seqlen",
        "batch",
        "CLO heads persistent/prefetch/demoted",
        "CLO hit, reuse heads",
        "CLO hit, all non-persistent",
        "CLO MB/step",
        "RetroInfer-style hit (blocks)",
        "RetroInfer-style MB/step",
        f"{paper.TAB4}: CLO",
    ]
    budget = fig10_throughput.budget_text(d["budget_gb"])
    return (
        md(head, rows)
        + f"\n\n{d['model']} with synthetic weights, Figure 10's workload and runs (each point's fastest), {budget}; "
        + f"the paper's RetroInfer range is {'-'.join(map(str, paper.TAB4_HIT_RATE_PERCENT['retroinfer']))}%. "
        + f"CLO's reuse thresholds follow its head importance ({d['importance']}; Eq. 7-9: the less important a "
        + "head, the looser its threshold), which the real-weight SmolLM2 rows above (uniform importance) lack. "
        + source(folder, d["records"])
    )


def main() -> None:
    ap = plot_arguments(__doc__, mixed=True)
    args = ap.parse_args()
    d = plot(args.root, args.out, args.allow_mixed_commits)
    for r in d["rows"]:
        cells = [f"{label} {r[s][key] * 100:.1f}%" for s, key, label in SERIES if r[s] is not None]
        print(f"{tokens(r['seqlen']):>6} batch {r['batch']:>3}: " + "; ".join(cells))


if __name__ == "__main__":
    cli(main)
