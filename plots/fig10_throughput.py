"""Paper Figure 10: decode throughput against batch size, one panel per sequence length, one line per system; below,
CLO's throughput over the best offloading baseline at each point, against the paper's range for that model.
Reads run records (experiments.run over system x batch x seqlen); where one point has several records (decode
modes), the fastest; a point the preflight refused is drawn as a cross: "OOM" where the device budget does not hold
it (the paper's missing bars), "RAM" where the host's memory does not hold its KV. Records of several commits are
refused unless --allow-mixed-commits (the title then lists them); records of several device budgets
(hardware.gpu_mem_gb: the paper's 48 GB grid and the same without a budget) are refused: one figure, one budget.

    python -m plots.fig10_throughput results/fig10_throughput --out fig10 --allow-mixed-commits
"""

from __future__ import annotations

import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvoffload.units import parse_tokens  # noqa: E402
from plots import paper  # noqa: E402
from plots.records import (  # noqa: E402
    ONE_EACH,
    SYSTEMS,
    RecordError,
    cli,
    fit_refusal,
    load_records,
    one_value,
    override_values,
    plot_arguments,
    read_json,
    save,
    tokens,
)

BASELINES = ("retroinfer", "infinigen")  # the offloading baselines CLO is compared with
REFUSED_MARKERS = {"OOM": "x", "RAM": "+"}
REFUSED_LABELS = {"OOM": "refused: device budget (OOM)", "RAM": "refused: host RAM"}


def data(root: Path, allow_mixed: bool = False) -> dict:
    """{"points": {(system, seqlen, batch): {"decode_tokens_per_s", "prefill_tokens_per_s", "file", "metrics"}},
    "refused": [(system, seqlen, batch, "OOM" | "RAM")], "speedup": {(seqlen, batch): CLO / best baseline},
    "speedup_median": the same by each run's median step (None where a record has no steps), "budget_gb": the
    device budget (None: none), "model", "records"}."""
    recs = load_records(root, allow_mixed=allow_mixed)
    refused = refusals(root)
    budgets = {budget_of(r["record"]) for r in recs} | {budget for _, budget in refused}
    if len(budgets) > 1:  # a point's fastest run would mix the two grids, and a refusal would hide a run
        shown = ", ".join(f"{b} GB" if b else "none" for b in sorted(budgets, key=lambda b: b or 0))
        raise RecordError(
            f"records of several device budgets under {root} ({shown}; hardware.gpu_mem_gb): a figure draws one; "
            + ONE_EACH
        )
    links = {link_cap_of(r["record"]) for r in recs}
    if len(links) > 1:  # a capped link is another machine: its points are not the same grid's
        shown = ", ".join(f"{c:g} GB/s" if c else "none" for c in sorted(links, key=lambda c: c or 0))
        raise RecordError(
            f"records of several link caps under {root} ({shown}; hardware.link_gb_s): a figure draws one; " + ONE_EACH
        )
    points: dict[tuple, dict] = {}
    for r in recs:
        rec = r["record"]
        key, m = (rec["system"], rec["seqlen"], rec["batch"]), rec["metrics"]
        row = {
            "decode_tokens_per_s": m["decode_tokens_per_s"],
            "prefill_tokens_per_s": m.get("prefill_tokens_per_s"),
            "file": r["file"],
            "metrics": m,
            "median_ms_per_step": median_step_ms(rec),
        }
        if key not in points or row["decode_tokens_per_s"] > points[key]["decode_tokens_per_s"]:
            points[key] = row
    speedup, speedup_median = {}, {}
    for (s, n, b), row in points.items():
        base = [points[(x, n, b)] for x in BASELINES if (x, n, b) in points]
        if s == "clo" and base:
            speedup[(n, b)] = row["decode_tokens_per_s"] / max(x["decode_tokens_per_s"] for x in base)
            medians = [x["median_ms_per_step"] for x in base]
            if row["median_ms_per_step"] and all(medians):
                speedup_median[(n, b)] = min(medians) / row["median_ms_per_step"]
    return {
        "points": points,
        "refused": sorted(point for point, _ in refused),
        "speedup": speedup,
        "speedup_median": speedup_median,
        "budget_gb": budgets.pop(),
        "link_cap_gb_s": links.pop() if links else None,
        "model": one_value(recs, lambda r: r["model"], "models"),
        "records": recs,
    }


def by_point(d: dict) -> tuple[dict, dict, list[str]]:
    """data()'s runs and refusals keyed by (system, seqlen, batch) (a refusal's value "OOM" or "RAM"), and the
    systems that have either, in SYSTEMS' order: what a table or figure of the points lays out."""
    pts, refused = d["points"], {(s, n, b): why for s, n, b, why in d["refused"]}
    return pts, refused, [s for s in SYSTEMS if any(k[0] == s for k in (*pts, *refused))]


def median_step_ms(rec: dict) -> float | None:
    """The median of a run's measured decode steps (ms): the mean (decode_ms_per_step, the throughput) over a few
    steps moves with one slow step, and a system that waits on the host each layer has more of them."""
    n, steps = rec["metrics"].get("decode_steps_measured"), rec.get("steps") or []
    totals = [s.get("phase_ms", {}).get("total") for s in steps[len(steps) - n :]] if n and n <= len(steps) else []
    return statistics.median(totals) if totals and None not in totals else None


def budget_text(budget_gb: float | None) -> str:
    """A figure's device budget in words: 'a 48 GB device budget' or 'no device budget'."""
    return f"a {budget_gb:g} GB device budget" if budget_gb else "no device budget"


def budget_of(rec: dict) -> float | None:
    """The device budget a run record ran under (hardware.gpu_mem_gb; None: none)."""
    return (rec.get("config") or {}).get("hardware", {}).get("gpu_mem_gb")


def link_cap_of(rec: dict) -> float | None:
    """The link cap a run record ran under (hardware.link_gb_s; None: the real link)."""
    return (rec.get("config") or {}).get("hardware", {}).get("link_gb_s")


def refusals(root: Path) -> list[tuple[tuple[str, int, int, str], float | None]]:
    """((system, seqlen, batch, "OOM" | "RAM"), budget) of the runs the preflight refused before allocating, for
    the device budget (Figure 10's "OOM") or the host's RAM: their records hold the run's overrides, not its
    metrics."""
    out = []
    for path in sorted(Path(root).rglob("record*.json")):
        rec = read_json(path)
        if not fit_refusal(rec):
            continue  # a crash is not a refusal: plots.all reports the folder's other runs only
        over = override_values(rec.get("overrides", []))
        if {"system", "seqlen", "batch"} <= set(over):
            seqlen = parse_tokens(over["seqlen"])
            why = "RAM" if "of RAM on this host" in str(rec["error"]) else "OOM"
            out.append(((over["system"], seqlen, int(over["batch"]), why), budget_of(rec)))
    return out


def plot(root: Path, out: Path, allow_mixed: bool = False) -> dict:
    d = data(root, allow_mixed)
    pts = d["points"]
    seqlens = sorted({n for _, n, _ in pts} | {n for _, n, _, _ in d["refused"]})  # a length may have only refusals
    fig, axes = plt.subplots(2, len(seqlens), figsize=(4 * len(seqlens) + 1, 6.5), squeeze=False)
    for j, n in enumerate(seqlens):
        ax = axes[0][j]
        for i, s in enumerate(SYSTEMS):
            xs = sorted(b for x, m, b in pts if x == s and m == n)
            if xs:
                ax.plot(xs, [pts[(s, n, b)]["decode_tokens_per_s"] for b in xs], "o-", color=f"C{i}", label=SYSTEMS[s])
        floor = ax.get_ylim()[0]
        for why, marker in REFUSED_MARKERS.items():  # the point does not fit the budget (OOM) or the host (RAM)
            for i, s in enumerate(SYSTEMS):  # in the system's colour; the legend names the kind once, in grey
                xs = [b for x, m, b, w in d["refused"] if x == s and m == n and w == why]
                if xs:  # each system's cross a little apart: several systems refused at one batch all show
                    shift = 2 ** (0.06 * (i - (len(SYSTEMS) - 1) / 2))
                    ax.plot([b * shift for b in xs], [floor] * len(xs), marker, color=f"C{i}", ms=9)
            if any(m == n and w == why for _, m, _, w in d["refused"]):
                ax.plot([], [], marker, color="gray", ms=9, label=REFUSED_LABELS[why])
        ax.set_xscale("log", base=2)
        ax.set_title(f"{tokens(n)}", fontsize=9)
        ax.set_xlabel("batch")
        ax.set_ylabel("decode tokens/s")
        ax.legend(fontsize=7)
        ax2 = axes[1][j]
        xs = sorted(b for m, b in d["speedup"] if m == n)
        ax2.plot(xs, [d["speedup"][(n, b)] for b in xs], "o-", label="ours: CLO / best baseline")
        if d["model"] in paper.FIG10_SPEEDUP:
            lo, hi = paper.FIG10_SPEEDUP[d["model"]]
            ax2.axhspan(lo, hi, facecolor="none", hatch="//", edgecolor="gray", label=f"{paper.FIG10} ({d['model']})")
        ax2.axhline(1, color="black", lw=0.5)
        if xs:  # a length where no baseline ran (refused, or not yet run) has no ratio to draw
            ax2.set_xscale("log", base=2)
        else:
            ax2.text(0.5, 0.15, "CLO and a baseline ran at no batch", transform=ax2.transAxes, ha="center", fontsize=8)
        ax2.set_xlabel("batch")
        ax2.legend(fontsize=7)
    fig.suptitle(f"Fig. 10: {d['model']}, {budget_text(d['budget_gb'])}, {d['records'].commits_label}", fontsize=9)
    save(fig, out)
    return d | {"panels": seqlens}


def main() -> None:
    ap = plot_arguments(__doc__, mixed=True)
    args = ap.parse_args()
    d = plot(args.root, args.out, args.allow_mixed_commits)
    for (n, b), x in sorted(d["speedup"].items()):
        print(f"{tokens(n):>6} batch {b:>3}: CLO {x:.2f}x the best baseline")
    print(f"{len(d['records'].rows)} runs, {len(d['refused'])} refused -> {args.out}")


if __name__ == "__main__":
    cli(main)
