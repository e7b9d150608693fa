"""The generated blocks of results/tab4_hit_rate/README.md (plots.readmes): the runs' settings, the hit rate of
each system at each needle depth beside the paper's range, and the bytes each moves per step, from
plots.tab4_hit_rate's reading of the records."""

from __future__ import annotations

from pathlib import Path

from plots import paper, tab4_hit_rate
from plots.markdown import decode_setup, md, span
from plots.records import SYSTEMS

UNIT = {"clo": "head-wise approximate cache", "retroinfer": "block LRU"}


def setup(d: dict) -> str:
    retro = next((r["record"]["config"]["system"] for r in d["records"] if r["record"]["system"] == "retroinfer"), {})
    text = decode_setup(d["records"])
    if retro:
        text += (
            f" RetroInfer-style with {retro['block_size']}-token blocks, a {retro['cache_multiple']:g}x cache, "
            f"{retro['selection']}-granular selection."
        )
    return text


def table(d: dict) -> str:
    depths = sorted({r["needle_depth"] for r in d["rows"]})
    rows = []
    for s in tab4_hit_rate.CACHED:
        mine = {r["needle_depth"]: r for r in d["rows"] if r["system"] == s}
        if not mine:
            continue
        lo, hi = paper.TAB4_HIT_RATE_PERCENT[s]
        rate = [f"{mine[x]['hit_rate'] * 100:.1f}%" if x in mine else None for x in depths]
        mb = span([r["mb_per_step"] for r in mine.values()], "{:.1f}", " MB")
        rows.append([f"{SYSTEMS[s]} ({UNIT[s]})", *rate, f"{lo}-{hi}%", mb])
    head = ["system", *[f"depth {x}" for x in depths], "paper (Llama3/Qwen2.5, 8K)", "host->device per step"]
    return md(head, rows)


def findings(d: dict) -> str:
    mb = {s: [r["mb_per_step"] for r in d["rows"] if r["system"] == s] for s in tab4_hit_rate.CACHED}
    rate = {s: [r["hit_rate"] for r in d["rows"] if r["system"] == s] for s in tab4_hit_rate.CACHED}
    ratio = sum(mb["clo"]) / len(mb["clo"]) / (sum(mb["retroinfer"]) / len(mb["retroinfer"]))
    lower = max(rate["clo"]) < min(rate["retroinfer"])
    return f"CLO moves {ratio:.1f}x the bytes per step of the block LRU (means over the depths)" + (
        " for a lower hit rate." if lower else "."
    )


def blocks(folder: Path) -> dict[str, str]:
    d = tab4_hit_rate.data(folder)
    return {"setup": setup(d), "table": table(d), "findings": findings(d)}
