"""The generated blocks of results/fig10_prefill/README.md (plots.readmes): plots.fig10_prefill's table, each
system's prefill against FullAttn's where both ran in one sweep (and the target for CLO's), the points FullAttn
could not run, the device peaks against their plans, the refusals' estimates, and the older BSZ 16 runs' decode."""

from __future__ import annotations

from pathlib import Path

from plots import fig10_prefill, fig10_readme, fig10_throughput, fig10_variants_readme
from plots.markdown import compact_source, md, span
from plots.records import SYSTEMS, commit_of, tokens

TARGET = 0.8  # CLO's prefill over FullAttn's, at least, wherever FullAttn runs


def runs(folder: Path) -> tuple[dict, dict, dict]:
    """The runs by (system, seqlen, batch), the refusals, and each run's (commit, card): one sweep's runs share both."""
    d = fig10_readme.data(folder)
    pts, refused, _ = fig10_throughput.by_point(d)
    where = {r["file"]: (commit_of(r["record"]), r["record"]["environment"].get("gpu")) for r in d["records"]}
    return pts, refused, where


def against_full(pts: dict, where: dict) -> dict[str, dict[tuple, float]]:
    """system -> {(seqlen, batch): its prefill tokens/s over FullAttn's}, where FullAttn ran in the same sweep."""
    out: dict[str, dict] = {}
    for (s, n, b), p in sorted(pts.items()):
        full = pts.get(("fullattn", n, b))
        if s != "fullattn" and full and where[full["file"]] == where[p["file"]]:
            out.setdefault(s, {})[n, b] = p["prefill_tokens_per_s"] / full["prefill_tokens_per_s"]
    return {s: out[s] for s in SYSTEMS if s in out}


def findings(folder: Path) -> str:
    pts, refused, where = runs(folder)
    ratios = against_full(pts, where)
    out = []
    for s, by in ratios.items():
        text = f"- {SYSTEMS[s]}'s prefill over FullAttn's: " + ", ".join(
            f"{tokens(n)} BSZ {b} {x:.2f}x" for (n, b), x in by.items()
        )
        if s == "clo":
            met = sum(x >= TARGET for x in by.values())
            text = f"- **{text[2:]}** (target >= {TARGET}x: met at {met} of {len(by)} points where FullAttn ran)"
        out.append(text + ".")
    for n, b in sorted({(n, b) for s, n, b in refused if s == "fullattn"}):
        rates = [pts[s, n, b]["prefill_tokens_per_s"] for s in SYSTEMS if (s, n, b) in pts]
        if not rates:
            continue
        text = f"- {tokens(n)} BSZ {b}, FullAttn refused: the offloading systems prefill at "
        text += f"{span(rates, '{:,.0f}')} tokens/s"
        one = pts.get(("fullattn", n, 1))
        if one:
            full = one["prefill_tokens_per_s"]
            text += f", {span([x / full for x in rates])}x FullAttn's BSZ 1 rate at {tokens(n)} ({full:,.0f})"
        out.append(text + ".")
    seconds = {s: pts[s, n, b]["metrics"]["prefill_s"] for s, n, b in pts if (n, b) == (32768, 1)}
    if {"fullattn", "retroinfer"} <= set(seconds):
        out.append(
            f"- RetroInfer-style's prefill at 32K BSZ 1 is {seconds['retroinfer'] - seconds['fullattn']:.2f} s longer "
            f"than FullAttn's ({seconds['fullattn']:.2f} s)."
        )
    return "\n".join(out + [peaks(folder)])


def peaks(folder: Path) -> str:
    """Each commit's device peaks against their plans (weights + activations + device KV of `memory_plan_gb`)."""
    d = fig10_readme.data(folder)
    by: dict[str, list] = {}
    for r in d["records"]:
        rec = r["record"]
        plan = rec["memory_plan_gb"]
        planned = plan["weights"] + plan["activations"] + plan["kv_device"]
        by.setdefault(commit_of(rec), []).append((rec["metrics"]["peak_device_gb"], planned, rec["system"]))
    out = []
    for c, rows in sorted(by.items()):
        over = [f"{SYSTEMS[s]} {p:.2f} GB against {q:.2f}" for p, q, s in rows if p > q]
        out.append(
            f"{c}: {len(rows) - len(over)} of {len(rows)} below" + (f" ({', '.join(over)} above)" if over else "")
        )
    return "- Device peaks against their plans, by commit: " + "; ".join(out) + "."


def batch16(folder: Path) -> str:
    """The older BSZ 16 runs, with their decode (two steps, not a throughput: ../fig10_throughput measures it)."""
    pts, _, where = runs(folder)
    rows = [
        [
            SYSTEMS[s],
            f"{p['prefill_tokens_per_s']:,.0f}",
            f"{p['metrics']['prefill_s']:.1f}",
            f"{p['decode_tokens_per_s']:.1f}",
        ]
        for (s, n, b), p in sorted(pts.items(), key=lambda kv: list(SYSTEMS).index(kv[0][0]))
        if (n, b) == (32768, 16)
    ]
    cards = sorted(
        {f"{c}, {g}" for (s, n, b), p in pts.items() if (n, b) == (32768, 16) for c, g in [where[p["file"]]]}
    )
    table = md(["system", "prefill tokens/s", "prefill s", "decode tokens/s"], rows)
    return table + f"\n\n{'; '.join(cards)}."


def blocks(folder: Path) -> dict[str, str]:
    return {
        "table": compact_source(fig10_prefill.table(folder, folder.name)),
        "findings": findings(folder),
        "refusals": fig10_variants_readme.refusals(folder, ways_out=True),
        "batch16": batch16(folder),
    }
