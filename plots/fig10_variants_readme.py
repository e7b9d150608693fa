"""The generated blocks of the READMEs of Figure 10's other grids (plots.readmes): without a budget
(results/fig10_throughput_nobudget) and at Qwen2.5-14B shapes (results/fig10_throughput_qwen25). They are
fig10_readme's blocks, plus the points their prose discusses in detail and each commit's stage times, every number
from the records."""

from __future__ import annotations

import re
from pathlib import Path

from kvoffload.units import parse_tokens
from plots import fig10_readme, fig10_throughput
from plots.markdown import span
from plots.records import SYSTEMS, commit_of, fit_refusal, override_values, read_json, tokens

# the points each folder's prose discusses, (seqlen, batch): why a ratio is high or low there
DETAIL = {
    "fig10_throughput_nobudget": [
        (8192, 1),
        (8192, 2),
        (32768, 1),
        (32768, 16),
        (32768, 32),
        (131072, 4),
        (131072, 8),
        (524288, 1),
        (524288, 2),
    ],
    "fig10_throughput_qwen25": [(8192, 1), (32768, 1), (131072, 1), (131072, 2)],
    "fig10_beyond": [(720896, 1)],
}


def one(s: str, p: dict, rec: dict) -> str:
    """A system's run at a point: its step against its floor (and the floor's parts), link bytes, hit, plan."""
    m = p["metrics"]
    text = f"{SYSTEMS[s]} {m['decode_ms_per_step']:.2f} ms (median {p['median_ms_per_step']:.2f})"
    if m.get("system_floor_ms_per_step"):
        parts = m.get("system_floor_parts_ms") or {}
        text += f", {m['step_over_system_floor']:.2f}x its floor of {m['system_floor_ms_per_step']:.1f}"
        text += " (" + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()) + ")" if parts else ""
    if s != "fullattn":
        text += f", {m['bytes_h2d_per_step'] / 1e6:.0f} MB/step"
    if m.get("hit_rate") is not None:
        text += f", hit {m['hit_rate']:.3f}"
        if m.get("hit_rate_with_refreshes") is not None and s == "clo":
            text += f" / {m['hit_rate_with_refreshes']:.3f}"
    plan = (rec.get("system_state") or {}).get("plan") or {}
    if s == "clo" and plan:
        text += (
            f"; plan: {plan.get('persistent_heads', 0)} persistent, {plan.get('prefetch_heads', 0)} prefetch, "
            f"{plan.get('demoted_heads', 0)} demoted heads"
        )
    if m.get("kv_host_gb") is not None and s == "clo":
        text += f"; host KV {m['kv_host_gb']:.0f} GB, device KV {m['kv_device_gb']:.1f} GB"
    return text


def detail(folder: Path) -> str:
    d = fig10_readme.data(folder)
    pts, refused, _ = fig10_throughput.by_point(d)
    recs = {r["file"]: r["record"] for r in d["records"]}
    out = []
    for n, b in DETAIL.get(folder.name, []):
        ran = [one(s, pts[s, n, b], recs[pts[s, n, b]["file"]]) for s in SYSTEMS if (s, n, b) in pts]
        no = [f"{SYSTEMS[s]} {refused[s, n, b]}" for s in SYSTEMS if (s, n, b) in refused]
        ratio = d["speedup"].get((n, b))
        head = f"- **{tokens(n)} BSZ {b}**" + (f" ({ratio:.2f}x)" if ratio else "")
        out.append(head + ": " + "; ".join(ran + no) + ".")
    return "\n".join(out)


def stages(folder: Path) -> str:
    """Each commit's run points: how many, and the seconds of their stages (and of `allocate`, the pinning)."""
    by: dict[str, list[dict]] = {}
    for r in fig10_readme.data(folder)["records"]:
        by.setdefault(commit_of(r["record"]), []).append(r["record"])
    out = []
    for c, recs in sorted(by.items()):
        st = [x.get("stages") or {} for x in recs]
        total = sum(v.get("s") or 0 for s in st for v in s.values())
        alloc = sum((s.get("allocate") or {}).get("s") or 0 for s in st)
        out.append(f"{c}: {len(recs)} run points, {total:.0f} s of stages ({alloc:.0f} s `allocate`)")
    return "Stages by commit: " + "; ".join(out) + "."


def blocks(folder: Path) -> dict[str, str]:
    return {**fig10_readme.blocks(folder), "detail": detail(folder), "stages": stages(folder)}


def refusals(folder: Path, ways_out: bool = False) -> str:
    """Each refused point's estimate against the budget (its record's error), and the weights' share of the budget;
    with ways_out, the largest batch or length that fits by the same estimate (the error names them too)."""
    d = fig10_readme.data(folder)
    weights = {(r["record"].get("memory_plan_gb") or {}).get("weights") for r in d["records"]}
    out = []
    for path in sorted(folder.glob("record*.json")):
        rec = read_json(path)
        m = re.search(r"needs about (.*?) of GPU memory \((.*?)\) but the budget is ([\d.]+ GB)", str(rec.get("error")))
        if fit_refusal(rec) and m:
            over = override_values(rec.get("overrides", []))
            key = (parse_tokens(over["seqlen"]), int(over["batch"]), over["system"])
            ways = re.search(r"Ways out that fit by this estimate: (.*?)\. Or", str(rec["error"]))
            fits = f"; fits by it: {ways[1]}" if ways_out and ways else ""
            out.append((*key, f"{m[1]} ({m[2]}) against {m[3]}{fits}"))
    lines = [f"- {tokens(n)} BSZ {b}, {SYSTEMS[s]}: {text}" for n, b, s, text in sorted(out)]
    weights.discard(None)
    if weights:
        lines.append(f"- The weights in every run's `memory_plan_gb`: {span(weights, '{:.1f}', ' GB')}.")
    return "\n".join(lines)


def qwen25_blocks(folder: Path) -> dict[str, str]:
    return {**blocks(folder), "refusals": refusals(folder)}
