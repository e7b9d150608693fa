"""The generated blocks of results/link_cap/README.md (plots.readmes): each transfer path's achieved rate under
hardware.link_gb_s's caps, from one bench_link record made with --link-gb-s. The bulk copy and the UVA gather are
the paths the cap paces directly; the CPU gather is a gather on the host, then a copy at the cap, one after the
other, so its rate is set against what that sequence predicts from the same record's unpaced rows."""

from __future__ import annotations

from pathlib import Path

from plots import fig3_13_link
from plots.markdown import md, span
from plots.readme_parts import commit, machine

TOLERANCE = 0.10  # the cap is held when a paced path runs within this fraction of it (docs/gpu.md, "A slower link")
PACED = ("bulk", "uva")  # the paths the cap paces directly


def paths(rec: dict) -> list[tuple[str, int | None]]:
    return sorted({(r["path"], r["threads"]) for r in rec["rows"]}, key=lambda p: (p[0], p[1] or 0))


def name(path: str, threads: int | None) -> str:
    return {"bulk": "bulk copy", "uva": "UVA gather"}.get(path, f"CPU gather, {threads} threads")


def predicted(rec: dict, row: dict) -> float:
    """A paced CPU gather's GB/s if the host's gather and a copy at the cap run one after the other: the gather's
    own time is the unpaced path's less the unpaced bulk copy of the same bytes."""
    unpaced = {(r["path"], r["threads"], r["tokens"]): r for r in rec["rows"] if r.get("cap_gb_s") is None}
    whole, bulk = unpaced[row["path"], row["threads"], row["tokens"]], unpaced["bulk", None, row["tokens"]]
    gather_ms = whole["ms"] - row["bytes"] / bulk["gb_s"] / 1e6
    return row["bytes"] / 1e6 / (gather_ms + row["bytes"] / row["cap_gb_s"] / 1e6)


def blocks(folder: Path) -> dict[str, str]:
    d = fig3_13_link.data(folder)
    rec, caps = d["record"], d["record"]["link_caps_gb_s"]
    volumes = sorted({r["tokens"] for r in rec["rows"]})
    run = (
        f"{commit(rec).capitalize()}, {machine(rec)}; record `{d['records'].files[0]}` ({len(rec['rows'])} rows), "
        f"made by `{rec['command']}`. Caps {', '.join(f'{c:g}' for c in caps)} GB/s; each path at "
        f"{len(volumes)} volumes of {volumes[0]}-{volumes[-1]} tokens per KV head; unpaced bulk copy "
        f"{rec['bulk_unpaced_gb_s']} GB/s. Mechanism: {rec['mechanism']}."
    )
    ps = paths(rec)
    rows = [["none (GB/s)"] + [span([r["gb_s"] for r in d["rows"] if (r["path"], r["threads"]) == p]) for p in ps]]
    for cap in caps:
        mine = [r for r in rec["rows"] if r.get("cap_gb_s") == cap]
        rows.append([f"{cap:g}"] + [span([r["of_cap"] for r in mine if (r["path"], r["threads"]) == p]) for p in ps])
    table = md(["cap (GB/s)", *(name(*p) for p in ps)], rows)
    paced = [r for r in rec["rows"] if r.get("cap_gb_s") and r["path"] in PACED]
    worst = max(paced, key=lambda r: abs(1 - r["of_cap"]))
    held = all(abs(1 - r["of_cap"]) <= TOLERANCE for r in paced)
    gathers = [r for r in rec["rows"] if r.get("cap_gb_s") and r["path"] == "cpu_gather"]
    ratios = [r["gb_s"] / predicted(rec, r) for r in gathers]
    targets = (
        f"- Bulk copy and UVA gather under every cap: {span([r['of_cap'] for r in paced])} of the cap; the "
        f"furthest, {worst['of_cap']} ({name(worst['path'], worst['threads'])} at {worst['cap_gb_s']:g} GB/s, "
        f"{worst['tokens']} tokens): {'within' if held else 'not within'} ±{TOLERANCE:.0%}.\n"
        f"- CPU gather: {span([r['of_cap'] for r in gathers])} of the cap, bounded by the host's gather before "
        f"its copy; measured / predicted by the gather-then-capped-copy sequence: {span(ratios)} over "
        f"{len(gathers)} rows."
    )
    return {"run": run, "rates": table, "targets": targets}
