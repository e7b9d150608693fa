"""Paper Figure 2: per-layer decode latency by phase for each system, as a fraction of FullAttn's per-layer
latency in the same setting (the paper's "ideal"), with the paper's totals (hatched) beside ours. Reads the
records of `+experiment=fig2_breakdown` (one commit, one model and length); where a system has several (decode
modes, with and without phase timing), its fastest. A graph-replayed step has no phases of its own: its bar is split
as the kernels of its traced step split (`trace_phase_ms`, a run with trace_dir=), else it is all 'other'. Timing
phases and tracing slow a step (a piecewise one most: an event pair a phase and layer): where the fastest record
has neither, its bar is split as the fastest record that has one split. Where a baseline towers over the rest
the axis breaks (axis_break), so that FullAttn's and CLO's phases stay readable beside it.

    python -m plots.fig2_breakdown results/fig2_breakdown_128k --out fig2.png
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from plots import paper  # noqa: E402
from plots.markdown import f1, md, source  # noqa: E402
from plots.records import (  # noqa: E402
    SYSTEMS,
    RecordError,
    cli,
    load_records,
    one_value,
    paper_style,
    phases_of,
    plot_arguments,
    save,
    stacked_phases,
    tokens,
)

ORDER = list(SYSTEMS)


def has_split(rec: dict) -> bool:
    """Whether a record splits its step by phase: timed phases (a piecewise step) or a traced graph step's kernels."""
    traced = rec.get("trace_phase_ms")
    return rec.get("phases_timed", True) or (bool(traced) and sum(traced.values()) > 0)


def fastest(rows: list[dict]) -> dict | None:
    return min(rows, key=lambda r: r["record"]["metrics"]["decode_ms_per_step"], default=None)


def data(root: Path) -> dict:
    """{"systems": {name: {<phase>: per-layer ms, "percent_of_fullattn", "ms_per_step", "decode_mode", "file",
    "mgmt_percent", "split_file", "split_ms_per_step"}}, "records", "model", "seqlen", "batch"}. Each system's step
    is its fastest record's; where that record has no split of its own (a run without phase timing or a trace,
    which timing and tracing would slow), the step is split as the fastest record with one split."""
    recs = load_records(root)
    model = one_value(recs, lambda r: r["model"], "models")
    seqlen = one_value(recs, lambda r: r["seqlen"], "sequence lengths")
    batch = one_value(recs, lambda r: r["batch"], "batch sizes")
    phases = phases_of(recs)
    by_system: dict[str, list[dict]] = {}
    for row in recs:
        by_system.setdefault(row["record"]["system"], []).append(row)
    if "fullattn" not in by_system or len(by_system) < 2:
        raise RecordError(f"need records of fullattn and another system under {root}; found {', '.join(by_system)}")
    systems = {}
    for name in sorted(by_system, key=ORDER.index):
        step_row = fastest(by_system[name])
        split_row = (
            step_row
            if has_split(step_row["record"])
            else fastest([r for r in by_system[name] if has_split(r["record"])])
        )
        rec = (split_row or step_row)["record"]
        layers = rec["config"]["model"]["num_layers"]
        per_layer = {p: rec["metrics"]["phase_ms_per_step"][p] / layers for p in phases}
        traced = rec.get("trace_phase_ms")
        from_trace = not rec.get("phases_timed", True) and bool(traced) and sum(traced.values()) > 0
        if (
            from_trace
        ):  # a graph step: its time split as its traced step's kernels split (experiments.runner.trace_phases)
            step = sum(per_layer.values())
            per_layer = {p: step * traced.get(p, 0.0) / sum(traced.values()) for p in phases}
        ms = step_row["record"]["metrics"]["decode_ms_per_step"]
        # another record's split, in proportion: its phases scaled to this step's time
        scale = 1.0 if split_row in (None, step_row) else ms / layers / sum(per_layer.values())
        systems[name] = {
            **{p: v * scale for p, v in per_layer.items()},
            "ms_per_step": ms,
            "decode_mode": step_row["record"].get("decode_mode", "eager"),
            "phases_timed": split_row is not None,
            "phases_from_trace": from_trace,
            "file": step_row["file"],
            "split_file": split_row["file"] if split_row else None,
            "split_ms_per_step": rec["metrics"]["decode_ms_per_step"],
        }
    ideal = sum(systems["fullattn"][p] for p in phases)
    for row in systems.values():
        total = sum(row[p] for p in phases)
        row["percent_of_fullattn"] = total / ideal * 100
        row["mgmt_percent"] = row.get("cache_mgmt", 0.0) / total * 100 if row["phases_timed"] else None
    return {"systems": systems, "phases": phases, "records": recs, "model": model, "seqlen": seqlen, "batch": batch}


BAR = 0.36  # a bar's width; ours and the paper's sit side by side about a system's tick
BREAK_RATIO = 2.0  # the axis breaks where the next taller bar is this many times the one below it, or more
LOW_HEADROOM, HIGH_FOOT, HIGH_HEADROOM = 1.2, 0.8, 1.12  # the panels' limits about the bars either side of it


def axis_break(heights: list[float]) -> tuple[float, float, float] | None:
    """(lower panel's top, upper panel's bottom, upper panel's top) of a broken axis, or None for one axis.
    A broken axis, not a log one: each phase's segment keeps a height in proportion to its time, so a bar's
    stack still reads as a sum; the break goes in the widest gap between bar heights, so FullAttn and CLO fill
    the lower panel while the baselines' tall bars show their tops above it."""
    hs = sorted(h for h in heights if h > 0)
    gaps = [(hi / lo, lo, hi) for lo, hi in zip(hs, hs[1:])]
    if not gaps or max(gaps)[0] < BREAK_RATIO:
        return None
    _, below, above = max(gaps)
    return below * LOW_HEADROOM, above * HIGH_FOOT, hs[-1] * HIGH_HEADROOM


def broken_axes(cut: tuple[float, float, float] | None, width: float):
    """The figure and its axes, top first: two sharing x with break marks between, or one."""
    if cut is None:
        fig, ax = plt.subplots(figsize=(width, 3.4), layout="constrained")
        return fig, [ax]
    low_top, high_bottom, high_top = cut
    fig, (hi, lo) = plt.subplots(2, 1, sharex=True, figsize=(width, 3.8), height_ratios=[1, 2], layout="constrained")
    fig.get_layout_engine().set(hspace=0, h_pad=0.02)  # the panels close, one axis broken
    hi.set_ylim(high_bottom, high_top)
    lo.set_ylim(0, low_top)
    hi.spines.bottom.set_visible(False)
    lo.spines.top.set_visible(False)
    hi.tick_params(bottom=False)
    marks = {"marker": [(-1, -0.5), (1, 0.5)], "markersize": 8, "linestyle": "none", "color": "k", "clip_on": False}
    hi.plot([0, 1], [0, 0], transform=hi.transAxes, **marks)  # the break's slashes, at both panels' edges
    lo.plot([0, 1], [1, 1], transform=lo.transAxes, **marks)
    return fig, [hi, lo]


def label_top(axes, x: float, height: float, text: str) -> None:
    """A bar's total above it, on the panel that shows its top."""
    ax = next((a for a in axes if a.get_ylim()[0] <= height <= a.get_ylim()[1]), axes[-1])
    ax.text(x, height, text, ha="center", va="bottom", fontsize=7)


def tick_label(n: str, row: dict) -> str:
    """A system's name, its decode mode, and its share of cache management (the paper's beside RetroInfer-style's):
    under the axis, where it cannot run into a neighbouring bar's total."""
    mode = row["decode_mode"] + (", trace" if row["phases_from_trace"] else "")
    label = f"{SYSTEMS[n]}\n({mode})"
    if row["mgmt_percent"]:
        label += f"\ncache mgmt {row['mgmt_percent']:.1f}%"
    if n == "retroinfer":
        lo, hi = paper.FIG2_RETROINFER_MGMT_PERCENT
        label += f"\n(paper {lo:.0f}-{hi:.0f}%)"
    return label


def plot(root: Path, out: Path) -> dict[str, dict]:
    d = data(root)
    systems, phases = d["systems"], d["phases"]
    names = list(systems)
    ideal = sum(systems["fullattn"][q] for q in phases)
    shares = {p: [systems[n][p] / ideal * 100 for n in names] for p in phases}
    ref = {i: paper.FIG2_PERCENT_OF_IDEAL[n] for i, n in enumerate(names) if n in paper.FIG2_PERCENT_OF_IDEAL}
    ours_x = [i - BAR / 2 if i in ref else i for i in range(len(names))]
    totals = [systems[n]["percent_of_fullattn"] for n in names]
    with paper_style():
        fig, axes = broken_axes(axis_break([*totals, *ref.values()]), width=1.2 * len(names) + 0.9)
        for ax in axes:
            stacked_phases(ax, ours_x, shares, width=BAR)
            if ref:
                ax.bar(
                    [i + BAR / 2 for i in ref], list(ref.values()), width=BAR, fill=False, hatch="//", label=paper.FIG2
                )
        for x, total in zip(ours_x, totals):
            label_top(axes, x, total, f"{total:.0f}%")
        for i, v in ref.items():
            label_top(axes, i + BAR / 2, v, f"{v:.0f}%")
        axes[-1].set_xticks(range(len(names)), [tick_label(n, systems[n]) for n in names])
        fig.supylabel("per-layer decode latency, % of FullAttn", fontsize=8)
        axes[0].legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False)  # above: no bar under it
        fig.suptitle(f"Per-layer decode latency by phase: {d['model']}, {tokens(d['seqlen'])}, BSZ {d['batch']}")
        save(fig, out)
    return systems


def table(root: Path, folder: str) -> str:
    d = data(root)
    rows = []
    for n, r in d["systems"].items():
        ref = paper.FIG2_PERCENT_OF_IDEAL.get(n)
        lo, hi = paper.FIG2_RETROINFER_MGMT_PERCENT
        mgmt = {"clo": f"<{paper.FIG2_CLO_MGMT_PERCENT_BELOW:g}%", "retroinfer": f"{lo}-{hi}%"}.get(n)
        sync = r.get("launch_sync") * 1e3 if r["phases_timed"] and "launch_sync" in r else None
        rows.append(
            [
                SYSTEMS[n],
                r["decode_mode"],
                f"{r['ms_per_step']:.2f}",
                f1(r["percent_of_fullattn"], "%"),
                f1(ref, "%"),
                f"{r['percent_of_fullattn'] / ref:.2f}" if ref else None,
                f1(r["mgmt_percent"], "%"),
                mgmt,
                f1(sync),
                f1(paper.FIG2_LAUNCH_SYNC_US.get(n)),
            ]
        )
    clo = d["systems"].get("clo")
    lo, hi = paper.FIG2_SPEEDUP.get(d["model"], (None, None))
    times = [
        f"{SYSTEMS[b]} {d['systems'][b]['ms_per_step'] / clo['ms_per_step']:.1f}x"
        for b in d["systems"]
        if clo and b not in ("fullattn", "clo")
    ]
    note = f"\n\nTime per step as a multiple of CLO's: {', '.join(times)}"
    note += f"; the paper: {lo}-{hi}x ({d['model']}, Fig. 2/11)."
    head = [
        "system",
        "mode",
        "ms/step",
        "% of FullAttn",
        f"{paper.FIG2}: % of ideal",
        "ours / paper",
        "cache mgmt, % of step",
        "paper: cache mgmt",
        "launch/sync, µs/layer",
        "paper: launch/sync µs",
    ]
    return md(head, rows) + (note if times and lo else "") + "\n\n" + source(folder, d["records"])


def main() -> None:
    ap = plot_arguments(__doc__)
    args = ap.parse_args()
    for name, row in plot(args.root, args.out).items():
        print(f"{name:<12} {row['percent_of_fullattn']:6.0f}% of FullAttn per layer")


if __name__ == "__main__":
    cli(main)
