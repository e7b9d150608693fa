"""The generated blocks of results/fig10_beyond/README.md (plots.readmes): Figure 10's blocks (fig10_readme) for
the batches and lengths the paper does not run, plus what its prose explains: CLO's plan at each point (why 1K is
slow), the refusals' estimates and the largest point that fits by them, the 704K runs' pinning, and the same
quantities at Figure 10's own points (results/fig10_throughput, read beside it) that the prose compares with."""

from __future__ import annotations

from pathlib import Path

from plots import fig10_readme, fig10_throughput, fig10_variants_readme
from plots.markdown import span
from plots.records import SYSTEMS, commit_of, tokens

LONG = 720896  # 704K: the longest point that ran, the one the prose details
# Figure 10's points the prose compares with: small batches at 8K (CLO's plans full of prefetch heads, as at 1K
# here) and its longest, 512K BSZ 1 (hit rates at a length near 704K)
FIG10_FLOOR_POINTS = [(8192, 1), (8192, 2), (8192, 4)]
FIG10_LONG = (524288, 1)


def records(folder: Path) -> tuple[dict, dict, dict]:
    """data()'s runs by (system, seqlen, batch), its refusals, and each run's record by file."""
    d = fig10_readme.data(folder)
    pts, refused, _ = fig10_throughput.by_point(d)
    return pts, refused, {r["file"]: r["record"] for r in d["records"]}


def machines(folder: Path) -> str:
    """Each commit's runs: how many, on which card with how many cores."""
    by: dict[tuple, int] = {}
    for r in fig10_readme.data(folder)["records"]:
        env = r["record"]["environment"]
        key = (commit_of(r["record"]), env.get("gpu"), env.get("cpu_count"), env.get("gpu_mem_total_gb"))
        by[key] = by.get(key, 0) + 1
    return (
        "; ".join(
            f"{c}: {n} run points on an {gpu} ({mem:g} GB visible to torch), {cores} cores"
            for (c, gpu, cores, mem), n in sorted(by.items())
        )
        + "."
    )


def plan_of(rec: dict) -> dict:
    return (rec.get("system_state") or {}).get("plan") or {}


def plans(folder: Path) -> str:
    """CLO's plan at each point that ran (Eq. 12's N_p and the heads it made persistent, prefetch, demoted), the
    (sequence, head) pairs its prefetch heads refresh a step, and its step over its own floor."""
    pts, _, recs = records(folder)
    out = []
    for (s, n, b), p in sorted(pts.items()):
        if s != "clo":
            continue
        plan, m = plan_of(recs[p["file"]]), p["metrics"]
        out.append(
            f"- {tokens(n)} BSZ {b}: N_p {plan.get('n_p')}, {plan.get('persistent_heads', 0)} persistent, "
            f"{plan.get('prefetch_heads', 0)} prefetch, {plan.get('demoted_heads', 0)} demoted heads "
            f"({plan.get('persistent_heads', 0) + plan.get('prefetch_heads', 0)} of them not demoted); "
            f"{b * plan.get('prefetch_heads', 0):,} (sequence, prefetch head) pairs refreshed a step; "
            f"{m['bytes_h2d_per_step'] / 1e6:.0f} MB a step over the link; step {m['step_over_system_floor']:.2f}x "
            "its floor."
        )
    full = [(n, b, p) for (s, n, b), p in pts.items() if s == "fullattn"]
    for n, b, p in full:
        base = max(
            (pts[x, n, b] for x in fig10_throughput.BASELINES if (x, n, b) in pts),
            key=lambda q: q["decode_tokens_per_s"],
        )
        out.append(
            f"- FullAttn at {tokens(n)} BSZ {b}: {p['decode_tokens_per_s']:,.0f} tokens/s, "
            f"{p['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}x the best offloading baseline; its "
            f"device KV {p['metrics']['kv_device_gb']:.2f} GB."
        )
    return "\n".join(out)


def long_runs(folder: Path) -> str:
    """The 704K runs: the device KV each holds, the host stores each pins, and how long their stages took."""
    pts, _, recs = records(folder)
    out = []
    for s in SYSTEMS:
        p = pts.get((s, LONG, 1))
        if not p:
            continue
        rec = recs[p["file"]]
        st = rec.get("stages") or {}
        pinned = (rec.get("memory_plan_gb") or {}).get("kv_host_pinned")
        total = sum(v.get("s") or 0 for v in st.values())
        text = f"- {SYSTEMS[s]}: device KV {p['metrics']['kv_device_gb']:.1f} GB"
        if pinned:
            text += f", host stores pinned {pinned:.1f} (`memory_plan_gb.kv_host_pinned`)"
        text += f"; stages {total:.0f} s, {(st.get('allocate') or {}).get('s', 0):.0f} s of them `allocate`."
        out.append(text)
    return "\n".join(out)


def figure10(folder: Path) -> str:
    """The Figure 10 points the prose compares with, from results/fig10_throughput beside this folder."""
    d = fig10_throughput.data(folder.parent / "fig10_throughput", allow_mixed=True)
    pts = d["points"]
    recs = {r["file"]: r["record"] for r in d["records"]}
    ran = [(n, b) for n, b in FIG10_FLOOR_POINTS if ("clo", n, b) in pts]
    heads = [plan_of(recs[pts["clo", n, b]["file"]]).get("prefetch_heads", 0) for n, b in ran]
    floors = [pts["clo", n, b]["metrics"]["step_over_system_floor"] for n, b in ran]
    cards = sorted({recs[pts["clo", n, b]["file"]]["environment"].get("gpu") for n, b in ran})
    n, b = FIG10_LONG
    hits = [
        f"{SYSTEMS[s]} {pts[s, n, b]['metrics']['hit_rate']:.3f}" for s in ("clo", "retroinfer") if (s, n, b) in pts
    ]
    return (
        f"In `../fig10_throughput/` ({', '.join(cards)}): at "
        + ", ".join(f"{tokens(x)} BSZ {y}" for x, y in ran)
        + f" CLO's plans have {span(heads, '{:.0f}')} prefetch heads and it steps at {span(floors)}x its floor; at "
        f"{tokens(n)} BSZ {b} the hit rates are " + ", ".join(hits) + "."
    )


def blocks(folder: Path) -> dict[str, str]:
    return {
        "machines": machines(folder),
        "grid": fig10_readme.grid(folder),
        "table": fig10_readme.table(folder),
        "findings": fig10_readme.findings(folder),
        "plans": plans(folder),
        "detail": fig10_variants_readme.detail(folder),
        "refusals": fig10_variants_readme.refusals(folder, ways_out=True),
        "long": long_runs(folder),
        "figure10": figure10(folder),
        "stages": fig10_variants_readme.stages(folder),
    }
