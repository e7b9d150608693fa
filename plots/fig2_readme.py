"""The generated blocks of Figure 2's READMEs (plots.readmes): results/fig2_breakdown_128k (Llama-3-8B shapes),
results/fig2_breakdown_128k_qwen25 and results/fair_baselines_128k. Each has plots.fig2_breakdown's table; beside it
what the prose explains: each system's phases, its floor's parts (and its CPU gather's bandwidth, where it has one),
tracing's cost, the targets, and the numbers the prose compares with in a sibling folder (read beside this one)."""

from __future__ import annotations

from pathlib import Path

from plots import fig2_breakdown, fig10_throughput, paper
from plots.markdown import compact_source, md
from plots.records import SYSTEMS, read_json

PHASES = {
    "retrieval": "retrieval",
    "cache_mgmt": "cache mgmt",
    "transfer_exposed": "transfer exposed",
    "attention": "attention",
    "launch_sync": "launch/sync",
    "other": "other",
}
TARGET_FLOOR = 1.5  # a baseline's step over its own floor, at most
FAIR_BEFORE = "investigations/synthetic_workload_check/fig2_128k_de575a6"  # fair_baselines' "before" records


def data(folder: Path) -> tuple[dict, dict]:
    """fig2_breakdown.data() and each system's step record (the run its bar's time is)."""
    d = fig2_breakdown.data(folder)
    recs = {r["file"]: r["record"] for r in d["records"]}
    return d, {n: recs[row["file"]] for n, row in d["systems"].items()}


def layers_of(rec: dict) -> int:
    return rec["config"]["model"]["num_layers"]


def sparse_layers(rec: dict) -> int:
    return layers_of(rec) - (rec["config"]["system"].get("dense_layers") or 0)


def mode(row: dict) -> str:
    return row["decode_mode"] + (" (trace split)" if row["phases_from_trace"] else "")


def hit(m: dict) -> str | None:
    if m.get("hit_rate") is None:
        return None
    both = m.get("hit_rate_with_refreshes") not in (None, m["hit_rate"])
    return f"{m['hit_rate']:.3f}" + (f" / {m['hit_rate_with_refreshes']:.3f}" if both else "")


def moved(m: dict) -> list:
    """A run's hit rate, link MB a step, host syncs a step and step over its own floor: the table's last columns."""
    floor = m.get("step_over_system_floor")
    return [hit(m), f"{m['bytes_h2d_per_step'] / 1e6:.0f}", f"{m['host_syncs_per_step']:.0f}", floor and f"{floor:.2f}"]


def per_layer(folder: Path) -> str:
    """Each system's untimed step per layer (µs), split into phases as the table's bar is, and what it moves."""
    d, step = data(folder)
    full = d["systems"]["fullattn"]["ms_per_step"]
    rows = []
    for n, row in d["systems"].items():
        layer = row["ms_per_step"] / layers_of(step[n]) * 1e3
        cells = [f"{row[p] * 1e3:.0f}" for p in PHASES]
        if row["mgmt_percent"]:
            cells[1] += f" ({row['mgmt_percent']:.1f}%)"
        pct = f"{100 * row['ms_per_step'] / full:.0f}%"
        rows.append([SYSTEMS[n], mode(row), f"{layer:.0f}", pct, *cells, *moved(step[n]["metrics"])])
    head = ["system", "mode", "per layer", "% of FullAttn", *PHASES.values()]
    return md([*head, "hit rate", "link MB/step", "host syncs/step", "step / own floor"], rows)


def gather(rec: dict) -> str:
    """A run's CPU gather bandwidth alone and inside its steps (system_state.cpu_gather_gb_s), where it has one."""
    g = (rec.get("system_state") or {}).get("cpu_gather_gb_s") or {}
    alone = g.get("alone") or max((g.get("alone_by_threads") or {0: None}).values(), default=None)
    text = f"its gather alone at {alone:.1f} GB/s" if alone else ""
    if g.get("in_steps"):
        text += f", inside the steps at {g['in_steps']:.1f} GB/s"
    return text


def floors(folder: Path) -> str:
    """Each offloading system's floor as the sum of its parts, the step over it, and its gather's bandwidth."""
    d, step = data(folder)
    out = []
    for n in d["systems"]:
        m = step[n]["metrics"]
        parts = m.get("system_floor_parts_ms") or {}
        if n == "fullattn" or not parts:
            continue
        terms = " + ".join(f"{v:.2f} ({k})" for k, v in parts.items())
        g = gather(step[n])
        out.append(
            f"- {SYSTEMS[n]}: {terms} = {m['system_floor_ms_per_step']:.2f} ms; its step "
            f"{m['decode_ms_per_step']:.2f}, {m['step_over_system_floor']:.2f}x" + (f"; {g}" if g else "") + "."
        )
    return "\n".join(out)


def traced(folder: Path) -> str:
    """Traced (or phase-timed) step against the untimed one, each system; RetroInfer-style's host LRU in both."""
    d, step = data(folder)
    recs = {r["file"]: r["record"] for r in d["records"]}
    pairs = [(n, r) for n, r in d["systems"].items() if r["split_file"] and r["split_file"] != r["file"]]
    out = "Traced / untimed step, ms: " + ", ".join(
        f"{SYSTEMS[n]} {r['split_ms_per_step']:.2f} / {r['ms_per_step']:.2f}" for n, r in pairs
    )
    r = d["systems"].get("retroinfer")
    if r and r["split_file"] and r["split_file"] != r["file"]:
        lru = recs[r["split_file"]]["metrics"]["system_floor_parts_ms"]["host_work"]
        untimed = step["retroinfer"]["metrics"]["system_floor_parts_ms"]["host_work"]
        out += (
            f". RetroInfer-style's host LRU took {lru:.2f} ms a step traced, {untimed:.2f} untimed: its bar's cache "
            f"management is {r['mgmt_percent']:.1f}%, of which at most {100 * untimed / r['ms_per_step']:.0f}% is "
            "in the untimed step"
        )
    return out + "."


def targets(folder: Path) -> str:
    d, step = data(folder)
    out = []
    for n in ("retroinfer", "infinigen"):
        x = step[n]["metrics"].get("step_over_system_floor") if n in step else None
        if x:
            out.append(f"{SYSTEMS[n]} {x:.2f}x ({'met' if x <= TARGET_FLOOR else 'missed'})")
    return f"Each baseline's step <= {TARGET_FLOOR}x its own floor: " + ", ".join(out) + "."


def differs(folder: Path) -> str:
    """The measured quantities the prose's comparison with the paper's Figure 2 rests on."""
    d, step = data(folder)
    s = d["systems"]
    full, clo = step["fullattn"]["metrics"], step["clo"]["metrics"]
    link = (step["clo"].get("system_state") or {}).get("link_gb_s")
    inf, ret = s["infinigen"], s["retroinfer"]
    per = step["infinigen"]["metrics"]["bytes_h2d_per_step"] / sparse_layers(step["infinigen"]) / 1e6
    lo, hi = paper.FIG2_RETROINFER_MGMT_PERCENT
    clo_lo, clo_hi = paper.TAB4_HIT_RATE_PERCENT["clo"]
    r_lo, r_hi = paper.TAB4_HIT_RATE_PERCENT["retroinfer"]
    bar = sum(inf[p] for p in PHASES)
    return "\n".join(
        [
            f"- FullAttn reads the KV at {full['bandwidth_gb_s']:,.0f} GB/s (`bandwidth_gb_s`); the link measured "
            f"in CLO's run: {link:.1f} GB/s.",
            f"- InfiniGen-style gathers {per:.0f} MB per sparse layer; its exposed transfer is "
            f"{100 * inf['transfer_exposed'] / bar:.0f}% of its bar.",
            f"- RetroInfer-style's cache management: {ret['mgmt_percent']:.1f}% of its bar (paper: {lo}-{hi}%).",
            f"- Hit rates: CLO {clo['hit_rate']:.3f} over its reuse heads (paper Tab. 4 at 8K: {clo_lo}-{clo_hi}%), "
            f"RetroInfer-style {step['retroinfer']['metrics']['hit_rate']:.3f} (paper: {r_lo}-{r_hi}%).",
        ]
    )


def llama3_blocks(folder: Path) -> dict[str, str]:
    return {
        "layers": per_layer(folder),
        "table": compact_source(fig2_breakdown.table(folder, folder.name)),
        "traced": traced(folder),
        "floors": floors(folder),
        "targets": targets(folder),
        "differs": differs(folder),
    }


def floor_table(folder: Path) -> str:
    d, step = data(folder)
    rows = []
    for n in d["systems"]:
        m = step[n]["metrics"]
        own = m.get("system_floor_ms_per_step")
        rows.append([SYSTEMS[n], f"{m['decode_ms_per_step']:.2f}", own and f"{own:.2f}", *moved(m)])
    head = ["system", "ms/step", "own floor", "hit rate (lookups / with prefetch heads)", "link MB/step"]
    return md([*head, "host syncs/step", "step / own floor"], rows)


def against_llama3(folder: Path) -> str:
    """CLO here against CLO in results/fig2_breakdown_128k (Llama-3-8B shapes), and against each baseline here;
    InfiniGen-style's step against its Figure 10 run at the same point (results/fig10_throughput_qwen25)."""
    d, step = data(folder)
    l3, l3step = data(folder.parent / "fig2_breakdown_128k")
    here, there = step["clo"]["metrics"], l3step["clo"]["metrics"]
    s = d["systems"]
    out = [
        f"- CLO {s['clo']['ms_per_step'] / s['fullattn']['ms_per_step']:.2f}x FullAttn's step "
        f"({s['clo']['ms_per_step']:.2f} against {s['fullattn']['ms_per_step']:.2f} ms; at Llama-3-8B shapes "
        f"{l3['systems']['clo']['ms_per_step'] / l3['systems']['fullattn']['ms_per_step']:.2f}x); "
        f"{here['bytes_h2d_per_step'] / 1e6:.0f} MB a step over the link ({there['bytes_h2d_per_step'] / 1e6:.0f} at "
        f"Llama-3-8B), hit {here['hit_rate']:.3f} ({there['hit_rate']:.3f} at Llama-3-8B); step over its floor "
        f"{here['step_over_system_floor']:.2f}x.",
        "- Each baseline's step over CLO's: "
        + ", ".join(
            f"{SYSTEMS[n]} {s[n]['ms_per_step'] / s['clo']['ms_per_step']:.2f}x"
            for n in s
            if n not in ("fullattn", "clo")
        )
        + f"; RetroInfer-style's launch/sync {s['retroinfer']['launch_sync'] * 1e3:.1f} µs a layer, "
        f"{step['retroinfer']['metrics']['host_syncs_per_step']:.0f} host syncs a step.",
    ]
    f10 = fig10_throughput.data(folder.parent / "fig10_throughput_qwen25", allow_mixed=True)
    p = f10["points"].get(("infinigen", d["seqlen"], d["batch"]))
    if p:
        rec = read_json(folder.parent / "fig10_throughput_qwen25" / p["file"])
        ms = p["metrics"]["decode_ms_per_step"]
        out.append(
            f"- InfiniGen-style's step here {s['infinigen']['ms_per_step'] / ms:.2f}x its Figure 10 run's "
            f"({ms:.2f} ms, `../fig10_throughput_qwen25/`, {rec['decode_mode']}): here {gather(step['infinigen'])}; "
            f"there {gather(rec)}."
        )
    return "\n".join(out)


def qwen25_blocks(folder: Path) -> dict[str, str]:
    return {
        "table": compact_source(fig2_breakdown.table(folder, folder.name)),
        "floors": floor_table(folder),
        "findings": against_llama3(folder),
    }


def fair_table(folder: Path) -> str:
    """Each system's step, its phases (ms a step; a graph step has none of its own: all 'other'), its floor, what it
    moves, and its step in the 'before' records (FAIR_BEFORE, read beside this folder)."""
    d, step = data(folder)
    before, _ = data(folder.parent / FAIR_BEFORE)
    full = d["systems"]["fullattn"]["ms_per_step"]
    rows = []
    for n, row in d["systems"].items():
        m, layers = step[n]["metrics"], layers_of(step[n])
        own = m.get("system_floor_ms_per_step")
        was = before["systems"].get(n)
        rows.append(
            [
                SYSTEMS[n],
                f"{row['ms_per_step']:.2f}",
                f"{100 * row['ms_per_step'] / full:.0f}%",
                *(f"{row[p] * layers:.1f}" for p in PHASES),
                own and f"{own:.2f}",
                *moved(m),
                was and f"{was['ms_per_step']:.2f}",
            ]
        )
    head = ["system", "ms/step", "of FullAttn", *PHASES.values(), "own floor", "hit rate", "link MB/step"]
    return md([*head, "host syncs/step", "step / own floor", "before (de575a6)"], rows)


def busy(folder: Path, n: str) -> str:
    """The compute stream's busy time in a system's traced step (timeline_<system>.json, step_timeline's summary)."""
    path = folder / f"timeline_{n}.json"
    if not path.exists():
        return ""
    t = read_json(path)
    on = t["busy_us_by_stream"][str(t["compute_stream"])]
    return f"; its traced step: the compute stream busy {on / 1e3:.1f} of {t['span_us'] / 1e3:.1f} ms"


def fair_findings(folder: Path) -> str:
    d, step = data(folder)
    before, _ = data(folder.parent / FAIR_BEFORE)
    s = d["systems"]
    r, i = s["retroinfer"], s["infinigen"]
    rm, im = step["retroinfer"]["metrics"], step["infinigen"]["metrics"]
    layers = layers_of(step["retroinfer"])
    link = (step["retroinfer"].get("system_state") or {}).get("link_gb_s")
    r_mb, r_ms = rm["bytes_h2d_per_step"] / 1e6, r["transfer_exposed"] * layers
    i_ms = i["transfer_exposed"] * layers_of(step["infinigen"])
    i_gb, full = im["bytes_h2d_per_step"] / 1e9, s["fullattn"]["ms_per_step"]
    return "\n".join(
        [
            f"- RetroInfer-style {before['systems']['retroinfer']['ms_per_step'] / r['ms_per_step']:.1f}x faster "
            f"than before; its transfer {r_ms:.1f} ms for {r_mb:.0f} MB, {r_mb / r_ms:.0f} GB/s, "
            f"{r_mb / r_ms / link:.2f} of the link measured in the run ({link:.1f} GB/s); retrieval "
            f"{r['retrieval'] * 1e3:.0f} µs and cache management {r['cache_mgmt'] * 1e3:.0f} µs a layer"
            + busy(folder, "retroinfer")
            + ".",
            f"- InfiniGen-style {before['systems']['infinigen']['ms_per_step'] / i['ms_per_step']:.1f}x faster than "
            f"before; it moves {i_gb:.1f} GB a step at {i_gb * 1e3 / i_ms:.0f} "
            "GB/s exposed" + busy(folder, "infinigen") + ".",
            f"- Of FullAttn's step: RetroInfer-style {100 * r['ms_per_step'] / full:.0f}%, "
            f"InfiniGen-style {100 * i['ms_per_step'] / full:.0f}%; RetroInfer-style's hit rate "
            f"{rm['hit_rate']:.2f}; over their own floors {rm['step_over_system_floor']:.2f}x and "
            f"{im['step_over_system_floor']:.2f}x (target <= {TARGET_FLOOR}x).",
        ]
    )


def fair_blocks(folder: Path) -> dict[str, str]:
    return {
        "steps": fair_table(folder),
        "findings": fair_findings(folder),
        "table": compact_source(fig2_breakdown.table(folder, folder.name)),
    }
