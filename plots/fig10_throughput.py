"""Paper Figure 10: decode throughput against batch size, one panel per sequence length, one line per system; below,
CLO's throughput over the best offloading baseline at each point, against the paper's range for that model.
Reads run records (experiments.run over system x batch x seqlen); where one point has several records (decode
modes), the fastest; a point the preflight refused is drawn below zero in the refused system's colour: a cross
where the device budget does not hold it (the paper's missing bars), a plus where the host's memory does not hold
its KV. Each panel ticks the batches of its length only. Records of several commits are refused unless
--allow-mixed-commits (plots.all's caption names them); records of several device budgets
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
from plots.markdown import f1, md, source  # noqa: E402
from plots.records import (  # noqa: E402
    ONE_EACH,
    SYSTEMS,
    RecordError,
    cli,
    commit_of,
    fit_refusal,
    load_records,
    one_value,
    override_values,
    paper_style,
    plot_arguments,
    read_json,
    save,
    tokens,
)

BASELINES = ("retroinfer", "infinigen")  # the offloading baselines CLO is compared with
REFUSED_MARKERS = {"OOM": "x", "RAM": "+"}
REFUSED_LABELS = {"OOM": "refused (device budget)", "RAM": "refused (host RAM)"}
REFUSED_NOTE = "× and + below zero: a run the preflight refused, in that system's colour"


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
    dtypes = {kv_dtype_of(r["record"]) for r in recs}
    if len(dtypes) > 1:  # a point's fastest run would pick one dtype's run and hide the other's
        raise RecordError(
            f"records of several host KV dtypes under {root} ({', '.join(sorted(dtypes))}; kv_dtype): a figure "
            "draws one; " + ONE_EACH
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


def kv_dtype_of(rec: dict) -> str:
    """The host KV rows' dtype a run record ran with (kv_dtype; "model": the model's own)."""
    return (rec.get("config") or {}).get("kv_dtype", "model")


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


RATIO_LABEL = "CLO / best baseline (×)"
PANEL_WIDTH_IN = 1.7  # a length's panel: four of them span a two-column paper's width at PAPER_STYLE's sizes
PAD_OCTAVES = 0.5  # room either side of a panel's first and last batch
SPREAD_OCTAVES = 0.09  # how far apart the systems' refusal markers at one batch sit
NOTE_BOX = {"facecolor": "white", "edgecolor": "none"}  # a note in a panel, over the hatched range


def colour(system: str) -> str:
    """A system's colour in every figure of Figure 10's records (plots.fig10_prefill's bars too)."""
    return f"C{list(SYSTEMS).index(system)}"


def batch_axis(ax, batches: list[int]) -> None:
    """A log2 batch axis ticked at the grid's batches only, in plain numbers, padded half an octave either side:
    a panel of one batch shows that batch, not a 2^-1..2^1 span of batches nobody ran."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.minorticks_off()
    ax.set_xlim(min(batches) * 2**-PAD_OCTAVES, max(batches) * 2**PAD_OCTAVES)


def throughput_panel(ax, d: dict, n: int) -> None:
    """Each system's decode tokens/s against batch at length n; below the zero line, a marker where the
    preflight refused a point, in the refused system's colour and a little apart from the other systems'."""
    pts = d["points"]
    for s in SYSTEMS:
        xs = sorted(b for x, m, b in pts if x == s and m == n)
        if xs:
            ax.plot(xs, [pts[(s, n, b)]["decode_tokens_per_s"] for b in xs], "o-", ms=3, color=colour(s))
    refused = [(s, b, why) for s, m, b, why in d["refused"] if m == n]
    if not any(m == n for _, m, _ in pts):  # every run at this length refused: no throughput axis to read
        ax.set_yticks([])
        ax.text(0.5, 0.5, "every run refused", transform=ax.transAxes, ha="center", va="center", bbox=NOTE_BOX)
    top = ax.get_ylim()[1] if any(m == n for _, m, _ in pts) else 1.0
    ax.set_ylim(-0.12 * top, top)  # a strip under zero for the refusals: no line runs through them
    for s, b, why in refused:
        shift = 2 ** (SPREAD_OCTAVES * (list(SYSTEMS).index(s) - (len(SYSTEMS) - 1) / 2))
        ax.plot([b * shift], [-0.06 * top], REFUSED_MARKERS[why], color=colour(s), ms=5, mew=1.2)
    ax.set_title(tokens(n))


def ratio_panel(ax, d: dict, n: int) -> None:
    """CLO's decode throughput over the best offloading baseline's at each batch of length n, against the
    paper's range for the model (hatched)."""
    xs = sorted(b for m, b in d["speedup"] if m == n)
    ax.plot(xs, [d["speedup"][(n, b)] for b in xs], "o-", ms=3, color="black")
    if d["model"] in paper.FIG10_SPEEDUP:
        ax.axhspan(*paper.FIG10_SPEEDUP[d["model"]], facecolor="none", hatch="//", edgecolor="gray", lw=0)
    ax.axhline(1, color="black", lw=0.5)
    if not xs:  # a length where no baseline ran (refused, or not yet run) has no ratio to draw
        ax.text(
            0.5,
            0.5,
            "no batch with\nCLO and a baseline",
            transform=ax.transAxes,
            ha="center",
            va="center",
            bbox=NOTE_BOX,
        )
    ax.set_xlabel("batch")


def legend_handles(d: dict) -> tuple[list, list[str], dict]:
    """The figure's one legend: the systems drawn, each kind of refusal as a marker in each refused system's
    colour (which system a marker is: its colour), CLO's ratio and the paper's range; and the handler map that
    draws a tuple of markers side by side."""
    from matplotlib.legend_handler import HandlerTuple
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    shown = [s for s in SYSTEMS if any(k[0] == s for k in d["points"])]
    handles = [Line2D([], [], marker="o", ms=3, color=colour(s)) for s in shown]
    labels = [SYSTEMS[s] for s in shown]
    for why, marker in REFUSED_MARKERS.items():
        who = [s for s in SYSTEMS if any(x == s and w == why for x, _, _, w in d["refused"])]
        if who:
            handles.append(tuple(Line2D([], [], ls="", marker=marker, mew=1.2, color=colour(s)) for s in who))
            labels.append(REFUSED_LABELS[why])
    handles.append(Line2D([], [], marker="o", ms=3, color="black"))
    labels.append("ours: " + RATIO_LABEL.removesuffix(" (×)"))
    if d["model"] in paper.FIG10_SPEEDUP:
        handles.append(Patch(facecolor="none", hatch="//", edgecolor="gray"))
        labels.append(f"paper Fig. 10's range ({d['model']})")
    return handles, labels, {tuple: HandlerTuple(ndivide=None, pad=0)}


def plot(root: Path, out: Path, allow_mixed: bool = False) -> dict:
    d = data(root, allow_mixed)
    pts = d["points"]
    seqlens = sorted({n for _, n, _ in pts} | {n for _, n, _, _ in d["refused"]})  # a length may have only refusals
    with paper_style():
        fig, axes = plt.subplots(
            2,
            len(seqlens),
            figsize=(PANEL_WIDTH_IN * len(seqlens) + 0.6, 4.6),
            squeeze=False,
            sharex="col",
            height_ratios=[3, 2],
            layout="constrained",
        )
        for j, n in enumerate(seqlens):
            throughput_panel(axes[0][j], d, n)
            ratio_panel(axes[1][j], d, n)
            axes[1][j].sharey(axes[1][0])  # one ratio scale across lengths, read on the first panel's axis
            batch_axis(axes[0][j], sorted(batches_at(d, n)))  # the column's: the ratio below shares it
        axes[0][0].set_ylabel("decode tokens/s")
        axes[1][0].set_ylabel(RATIO_LABEL)
        handles, labels, handler_map = legend_handles(d)
        fig.legend(
            handles,
            labels,
            handler_map=handler_map,
            loc="outside lower center",
            ncol=4,
            frameon=False,
            title=REFUSED_NOTE if d["refused"] else None,
            title_fontsize=7,
        )
        fig.suptitle(f"Decode throughput against batch: {d['model']}, {budget_text(d['budget_gb'])}" + link_text(d))
        save(fig, out)
    return d | {"panels": seqlens}


def batches_at(d: dict, n: int) -> set[int]:
    """The batches run or refused at length n: a panel's ticks."""
    return {b for _, m, b in d["points"] if m == n} | {b for _, m, b, _ in d["refused"] if m == n}


def link_text(d: dict) -> str:
    """', link capped at 21.21 GB/s' where the records ran on a capped link; else nothing."""
    return f", link capped at {d['link_cap_gb_s']:g} GB/s" if d.get("link_cap_gb_s") else ""


def table(root: Path, folder: str) -> str:
    """Decode tokens/s of every system per point ("OOM": the preflight refused it), CLO over the best offloading
    baseline and the paper's range. The folder may hold records of several commits (plots.all's option): each
    point names its records' commits."""
    d = data(root, allow_mixed=True)
    lo, hi = paper.FIG10_SPEEDUP.get(d["model"], (None, None))
    pts, refused, shown = by_point(d)
    commits: dict[tuple, set] = {}
    for r in d["records"]:
        commits.setdefault((r["record"]["seqlen"], r["record"]["batch"]), set()).add(commit_of(r["record"]))
    rows = []
    for n, b in sorted({(n, b) for _, n, b in pts} | {(n, b) for _, n, b in refused}):
        cells = [
            f1(pts[(s, n, b)]["decode_tokens_per_s"]) if (s, n, b) in pts else refused.get((s, n, b)) for s in shown
        ]
        x, xm = d["speedup"].get((n, b)), d["speedup_median"].get((n, b))
        ratios = [f"{r:.2f}x" if r else None for r in (x, xm)]
        rows.append([tokens(n), b, *cells, *ratios, ", ".join(sorted(commits.get((n, b), ())))])
    by_median = "by median step"
    head = ["seqlen", "batch", *(f"{SYSTEMS[s]} tok/s" for s in shown), "CLO / best baseline", by_median, "commit"]
    budget = f"Device budget {d['budget_gb']:g} GB (hardware.gpu_mem_gb)" if d["budget_gb"] else "No device budget"
    ref = f"{budget}. " + (f"{paper.FIG10} ({d['model']}): {lo}-{hi}x. " if lo else "")
    ref += "OOM: refused for the device budget; RAM: for the host's. "
    ref += f"'{by_median}': the same ratio of each run's median step (tokens/s is its mean step)."
    return md(head, rows) + f"\n\n{ref} " + source(folder, d["records"]) + "\n\n" + floor_table(d)


def over_floor(m: dict, system: str) -> str | None:
    """'step / floor = x (MB/step, hit rate)' of one run's metrics (None for a run with no floor: FullAttn)."""
    if not m.get("system_floor_ms_per_step"):
        return None
    step, floor = m["decode_ms_per_step"], m["system_floor_ms_per_step"]
    extra = [f"{m['bytes_h2d_per_step'] / 1e6:.0f} MB"]
    if system == "clo" and m.get("hit_rate") is not None:  # its prefetch heads are fetched every step by design
        extra.append(f"hit {m['hit_rate']:.3f} / {m['hit_rate_with_refreshes']:.3f}")
    elif m.get("hit_rate") is not None:
        extra.append(f"hit {m['hit_rate']:.3f}")
    return f"{step:.2f} / {floor:.2f} = {step / floor:.2f}x ({', '.join(extra)})"


# what a floor cell's header names beside the bytes moved, by system (its hit rate otherwise)
FLOOR_EXTRA = {"clo": ", hit: lookups / with prefetch heads", "infinigen": ""}


def floor_table(d: dict) -> str:
    """Each system's step against its own floor at every Figure 10 point (the run plotted: the point's fastest),
    and CLO's device KV over RetroInfer-style's."""
    pts = d["points"]
    offloading = [s for s in SYSTEMS if s != "fullattn" and any(k[0] == s for k in pts)]
    rows = []
    for n, b in sorted({(n, b) for _, n, b in pts}):
        m = {s: pts[(s, n, b)]["metrics"] for s in SYSTEMS if (s, n, b) in pts}
        kv = (
            f"{m['clo']['kv_device_gb'] / m['retroinfer']['kv_device_gb']:.2f}x"
            if {"clo", "retroinfer"} <= set(m) and m["retroinfer"].get("kv_device_gb")
            else None
        )
        rows.append(
            [
                f"{tokens(n)} b{b}",
                f"{m['fullattn']['decode_ms_per_step']:.2f}" if "fullattn" in m else "OOM",
                *(over_floor(m[s], s) if s in m else None for s in offloading),
                kv,
            ]
        )
    head = [
        "point",
        "FullAttn ms/step",
        *(f"{SYSTEMS[s]} step / floor (MB/step{FLOOR_EXTRA.get(s, ', hit')})" for s in offloading),
        "CLO / RetroInfer-style device KV",
    ]
    return (
        "Each system against its own floor (`system_floor_ms_per_step`: device bytes / HBM + link bytes / link + its "
        "measured host work, each from the same run, summed: a system that overlaps them can step below it), ms per "
        "step, at the run plotted:\n\n" + md(head, rows)
    )


def main() -> None:
    ap = plot_arguments(__doc__, mixed=True)
    args = ap.parse_args()
    d = plot(args.root, args.out, args.allow_mixed_commits)
    for (n, b), x in sorted(d["speedup"].items()):
        print(f"{tokens(n):>6} batch {b:>3}: CLO {x:.2f}x the best baseline")
    print(f"{len(d['records'].rows)} runs, {len(d['refused'])} refused -> {args.out}")


if __name__ == "__main__":
    cli(main)
