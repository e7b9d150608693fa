"""Paper Figure 2: per-layer decode latency by phase for each system, as a fraction of FullAttn's per-layer
latency in the same setting (the paper's "ideal"), with the paper's totals (hatched) beside ours. Reads the
records of `+experiment=fig2_breakdown` (one commit, one model and length); where a system has several (decode
modes, with and without phase timing), its fastest. A graph-replayed step has no phases of its own: its bar is split
as the kernels of its traced step split (`trace_phase_ms`, a run with trace_dir=), else it is all 'other'. Timing
phases and tracing slow a step (a piecewise one most: an event pair a phase and layer): where the fastest record
has neither, its bar is split as the fastest record that has one split.

    python -m plots.fig2_breakdown results/fig2_breakdown_128k --out fig2.png
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from plots import paper  # noqa: E402
from plots.records import (  # noqa: E402
    SYSTEMS,
    RecordError,
    cli,
    load_records,
    one_value,
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
    "mgmt_percent", "split_file", "split_ms_per_step"}}, "records", "model", "seqlen"}. Each system's step is its
    fastest record's; where that record has no split of its own (a run without phase timing or a trace, which
    timing and tracing would slow), the step is split as the fastest record with one split."""
    recs = load_records(root)
    model = one_value(recs, lambda r: r["model"], "models")
    seqlen = one_value(recs, lambda r: r["seqlen"], "sequence lengths")
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
    return {"systems": systems, "phases": phases, "records": recs, "model": model, "seqlen": seqlen}


def plot(root: Path, out: Path) -> dict[str, dict]:
    d = data(root)
    systems, phases = d["systems"], d["phases"]
    names = list(systems)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = list(range(len(names)))
    totals = stacked_phases(
        ax,
        x,
        {p: [systems[n][p] / sum(systems["fullattn"][q] for q in phases) * 100 for n in names] for p in phases},
        width=0.4,
    )
    for i, (n, total) in enumerate(zip(names, totals)):
        mgmt = systems[n]["mgmt_percent"]
        note = f"{total:.0f}%" + (f"\nmgmt {mgmt:.1f}%" if mgmt else "")
        ax.text(i, total, note, ha="center", va="bottom", fontsize=7)
    ref = [(i, n) for i, n in enumerate(names) if n in paper.FIG2_PERCENT_OF_IDEAL]
    if ref:
        vals = [paper.FIG2_PERCENT_OF_IDEAL[n] for _, n in ref]
        ax.bar([i + 0.42 for i, _ in ref], vals, width=0.3, fill=False, hatch="//", edgecolor="black", label=paper.FIG2)
        for (i, n), v in zip(ref, vals):
            mg = paper.FIG2_RETROINFER_MGMT_PERCENT
            note = f"{v:.0f}%" + (f"\nmgmt {mg[0]:.0f}-{mg[1]:.0f}%" if n == "retroinfer" else "")
            ax.text(i + 0.42, v, note, ha="center", va="bottom", fontsize=7)
    labels = [
        f"{SYSTEMS[n]}\n({systems[n]['decode_mode']}{', trace' if systems[n]['phases_from_trace'] else ''})"
        for n in names
    ]
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("per-layer decode latency, % of FullAttn")
    ax.set_title(f"Fig. 2: {d['model']}, {tokens(d['seqlen'])}, commit {d['records'].commit}", fontsize=9)
    ax.legend(fontsize=7)
    save(fig, out)
    return systems


def main() -> None:
    ap = plot_arguments(__doc__)
    args = ap.parse_args()
    for name, row in plot(args.root, args.out).items():
        print(f"{name:<12} {row['percent_of_fullattn']:6.0f}% of FullAttn per layer")


if __name__ == "__main__":
    cli(main)
