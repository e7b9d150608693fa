"""The generated blocks of a Figure 10 folder's README.md (plots.readmes): the grid's size, the table of
plots.fig10_throughput, what the runs show and where the targets stand, every number from the records."""

from __future__ import annotations

from pathlib import Path

from plots import fig10_throughput, paper
from plots.markdown import compact_source, span
from plots.records import SYSTEMS, tokens

# Figure 10's targets (results/fig10_throughput/README.md, "Targets"): the ratio over the best baseline, CLO's
# batches under the budget, its step over its own floor from this batch on, its device KV over RetroInfer-style's
TARGET_RATIO = 1.5
TARGET_BATCH = {32768: 16, 131072: 4}
TARGET_FLOOR, FLOOR_FROM_BATCH = 1.3, 8
TARGET_KV = 0.5


def data(folder: Path) -> dict:
    return fig10_throughput.data(folder, allow_mixed=True)


def point(n: int, b: int) -> str:
    return f"{tokens(n)} BSZ {b}"


def table(folder: Path) -> str:
    return compact_source(fig10_throughput.table(folder, folder.name))


def grid(folder: Path) -> str:
    d = data(folder)
    pts, refused, shown = fig10_throughput.by_point(d)
    keys = set(pts) | set(refused)
    lengths = ", ".join(tokens(n) for n in sorted({n for _, n, _ in keys}))
    batches = ", ".join(str(b) for b in sorted({b for _, _, b in keys}))
    return (
        f"{len(shown)} systems x BSZ {batches} x {lengths}: {len(keys)} points, {len(pts)} run, {len(refused)} "
        f"refused before any allocation, under {fig10_throughput.budget_text(d['budget_gb'])}."
    )


def largest_batches(pts: dict, system: str) -> dict[int, int]:
    out: dict[int, int] = {}
    for s, n, b in pts:
        if s == system:
            out[n] = max(out.get(n, 0), b)
    return dict(sorted(out.items()))


def findings(folder: Path) -> str:
    d = data(folder)
    pts, refused, _ = fig10_throughput.by_point(d)
    sp, spm = d["speedup"], d["speedup_median"]
    lo, hi = paper.FIG10_SPEEDUP.get(d["model"], (None, None))
    best = {
        (n, b): max(fig10_throughput.BASELINES, key=lambda s: pts.get((s, n, b), {}).get("decode_tokens_per_s", 0))
        for n, b in sp
    }
    bests = sorted({SYSTEMS[s] for s in best.values()})
    worst = min(sp, key=sp.get)
    out = [
        f"- **CLO / best offloading baseline is {span(sp.values())}x at all {len(sp)} points where both run**"
        + (f" (paper {lo}-{hi}x)." if lo else ".")
        + f" The best baseline: {' or '.join(bests)}; the smallest ratio at {point(*worst)}, {sp[worst]:.2f}x."
    ]
    if spm:
        jitter = {
            s: max(p["metrics"]["decode_ms_per_step"] / p["median_ms_per_step"] for p in runs)
            for s in SYSTEMS
            for runs in [[p for (x, _, _), p in pts.items() if x == s and p["median_ms_per_step"]]]
            if runs
        }
        out.append(
            f"- **By each run's median step the ratios are {span(spm.values())}x** (the table's \"by median step\"). "
            "A run's mean step over its median, at most: "
            + ", ".join(f"{SYSTEMS[s]} {r:.2f}x" for s, r in jitter.items())
            + ". The tokens/s are the means: throughput is what the figure is; the median says how much of a "
            "ratio is jitter."
        )
    for s in ("clo", "fullattn"):
        big = largest_batches(pts, s)
        nxt = {
            n: min(
                ((b, why) for (x, m, b), why in refused.items() if x == s and m == n and b > big.get(n, 0)),
                default=None,
            )
            for n in sorted({m for _, m, _ in (*pts, *refused)})
        }
        ran = ", ".join(f"BSZ {b} at {tokens(n)}" for n, b in big.items()) or "none"
        stop = ", ".join(f"{point(n, nb[0])} {nb[1]}" for n, nb in nxt.items() if nb)
        out.append(f"- {SYSTEMS[s]}'s largest batch that ran: {ran}; its next one refused: {stop}.")
    faster, slower = [], []
    for (s, n, b), p in sorted(pts.items()):
        full = pts.get(("fullattn", n, b))
        if s == "clo" and full:
            c, f = p["metrics"]["decode_ms_per_step"], full["metrics"]["decode_ms_per_step"]
            (faster if c < f else slower).append((n, b, c, f))
    ahead = [100 * (c / f - 1) for *_, c, f in slower]
    if faster:
        out.append(
            "- **CLO is faster than FullAttn at "
            + ", ".join(f"{point(n, b)} ({c:.2f} vs {f:.2f} ms)" for n, b, c, f in faster)
            + "**"
            + (f"; at the other points FullAttn is {span(ahead, '{:.1f}', ' %')} faster." if slower else ".")
        )
    elif slower:
        out.append(
            f"- **FullAttn is faster than CLO at every point where both run**, by {span(ahead, '{:.1f}', ' %')}."
        )
    recs = {r["file"]: r["record"] for r in d["records"]}
    peaks = []
    for (s, n, b), p in pts.items():
        plan = recs[p["file"]].get("memory_plan_gb")
        if plan and p["metrics"].get("peak_device_gb") is not None:
            peaks.append(
                (p["metrics"]["peak_device_gb"], plan["weights"] + plan["activations"] + plan["kv_device"], s, n, b)
            )
    if peaks:
        over = [x for x in peaks if x[0] > x[1]]
        top = max(peaks)
        head = "Every device peak is below its plan" if not over else f"{len(over)} device peaks exceed their plan"
        out.append(
            f"- **{head}** (weights + activations + device KV of `memory_plan_gb`); the largest is "
            f"{top[0]:.2f} GB ({SYSTEMS[top[2]]} {point(top[3], top[4])})."
        )
    out.append(hit_rates(pts))
    return "\n".join(out)


def hit_rates(pts: dict) -> str:
    clo = {k: p["metrics"] for k, p in pts.items() if k[0] == "clo" and p["metrics"].get("hit_rate") is not None}
    by_len: dict[int, list[float]] = {}
    for (_, n, _), m in clo.items():
        by_len.setdefault(n, []).append(m["hit_rate"])
    refreshed = [m["hit_rate_with_refreshes"] for m in clo.values() if m["hit_rate_with_refreshes"] < m["hit_rate"]]
    retro = [p["metrics"]["hit_rate"] for k, p in pts.items() if k[0] == "retroinfer" and p["metrics"].get("hit_rate")]
    text = "- CLO's hit rate over its reuse heads, by length: " + ", ".join(
        f"{tokens(n)} {span(v, '{:.3f}')}" for n, v in sorted(by_len.items())
    )
    if refreshed:
        text += f"; over every non-persistent head, prefetch heads counted as fetched, {span(refreshed, '{:.3f}')} "
        text += "where the plan has prefetch heads"
    lo, hi = paper.TAB4_HIT_RATE_PERCENT["clo"]
    text += f" (the paper's Table 4: {lo}-{hi} %)."
    if retro:
        text += f" RetroInfer-style's, over its blocks, {span(retro, '{:.3f}')}."
    return text


def missed(ratios: dict) -> str:
    """The points below the ratio target, named with their ratios (or the closest one when none is)."""
    below = sorted((k for k, x in ratios.items() if x < TARGET_RATIO), key=lambda k: ratios[k])
    if not below:
        worst = min(ratios, key=ratios.get)
        return f" (the closest {point(*worst)}, {ratios[worst]:.2f}x)"
    return " (missed at " + ", ".join(f"{point(*k)} {ratios[k]:.2f}x" for k in below) + ")"


def targets(folder: Path) -> str:
    d = data(folder)
    pts, _, _ = fig10_throughput.by_point(d)
    sp, spm = d["speedup"], d["speedup_median"]
    met = [k for k, x in sp.items() if x >= TARGET_RATIO]
    metm = [k for k, x in spm.items() if x >= TARGET_RATIO]
    out = [
        f"- CLO >= {TARGET_RATIO}x the best offloading baseline wherever both run: by throughput met at {len(met)} of "
        f"{len(sp)} points{missed(sp)}; by the median step at {len(metm)} of {len(spm)}{missed(spm)}."
    ]
    big = largest_batches(pts, "clo")
    want = ", ".join(
        f"{tokens(n)}: >= {b}, ran {big.get(n, 0)} ({'met' if big.get(n, 0) >= b else 'missed'})"
        for n, b in TARGET_BATCH.items()
    )
    grid = "under the budget" if d["budget_gb"] else "without a device budget"  # the nobudget grid has none
    out.append(f"- CLO's batches {grid} ({want}).")
    floors = [
        (n, b, p["metrics"]["step_over_system_floor"])
        for (s, n, b), p in sorted(pts.items())
        if s == "clo" and b >= FLOOR_FROM_BATCH and p["metrics"].get("step_over_system_floor")
    ]
    if floors:
        ok = [f"{point(n, b)} {x:.2f}x" for n, b, x in floors if x <= TARGET_FLOOR]
        miss = [f"{point(n, b)} {x:.2f}x" for n, b, x in floors if x > TARGET_FLOOR]
        out.append(
            f"- CLO's step <= {TARGET_FLOOR}x its own floor at BSZ >= {FLOOR_FROM_BATCH}: met at "
            + (", ".join(ok) or "none")
            + "; **missed at "
            + (", ".join(miss) or "none")
            + "**."
        )
    kv = [
        p["metrics"]["kv_device_gb"] / pts[("retroinfer", n, b)]["metrics"]["kv_device_gb"]
        for (s, n, b), p in pts.items()
        if s == "clo" and ("retroinfer", n, b) in pts and pts[("retroinfer", n, b)]["metrics"].get("kv_device_gb")
    ]
    if kv:
        state = "met" if max(kv) <= TARGET_KV else "missed"
        out.append(
            f"- CLO's device KV <= {TARGET_KV:.0%} of RetroInfer-style's: **{state}, {span(kv)}x** (last column of "
            "the floor table)."
        )
    stages: dict[str, float] = {}
    for r in d["records"]:
        for name, st in (r["record"].get("stages") or {}).items():
            stages[name] = stages.get(name, 0.0) + (st.get("s") or 0.0)
    if stages:
        out.append(
            f"- The run points' stages sum to {sum(stages.values()):.0f} s, {stages.get('allocate', 0):.0f} of them "
            "`allocate` (pinning host memory for the host stores)."
        )
    return "\n".join(out)


def blocks(folder: Path) -> dict[str, str]:
    return {"grid": grid(folder), "table": table(folder), "findings": findings(folder), "targets": targets(folder)}
