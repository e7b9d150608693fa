"""The generated blocks of results/tab6_memory/README.md (plots.readmes): how the table was made (which rows were
measured, which estimated, the CLO plan's inputs), plots.tab6_memory's table, and what it shows against the paper's
Table 6, every number from the memory table's JSON or plots.paper."""

from __future__ import annotations

from pathlib import Path

from plots import paper, tab6_memory
from plots.markdown import compact_source
from plots.records import commit_of, override_values, tokens

TARGET_PERCENT = 50  # the target: CLO's cache at most half RetroInfer-style's, at every length


def how(d: dict) -> str:
    rows, rec = d["rows"], next(iter(d["records"]))["record"]
    measured = sorted({r["seqlen"] for r in rows if r["source"] == "allocated buffers"})
    estimated = sorted({r["seqlen"] for r in rows if r["source"] == "estimate_parts"})
    equal = [r["estimate_equals_buffers"] for r in rows if r["source"] == "allocated buffers"]
    clo = override_values(rec.get("clo_overrides", []))
    sources = (
        f"Measured from the allocated buffers: {', '.join(tokens(n) for n in measured)} "
        f"(`estimate_equals_buffers` true in {sum(equal)} of {len(equal)} rows); `estimate_parts` alone: "
        if measured
        else "Every row from `estimate_parts` (no buffers allocated): "
    )
    return (
        f"{sources}{', '.join(tokens(n) for n in estimated)}. CLO's plan from a layer's dense compute of "
        f"{clo['system.layer_time_ms']} ms and a pinned copy of {clo['system.link_gb_s']} GB/s. Commit "
        f"{commit_of(rec)}, {rec['environment']['device']}."
    )


def findings(d: dict) -> str:
    rows = {(r["system"], r["seqlen"]): r for r in d["rows"]}
    cache = d["cache_ratio"]
    ns = sorted(cache)
    plans = {n: rows["clo", n]["describe"]["plan"] for n in ns}
    p_ratio = paper.TAB6_GB["clo"] / paper.TAB6_GB["retroinfer"] * 100
    ref = paper.TAB6_SEQLEN
    at = rows.get(("clo", ref))
    out = [
        "- **CLO's cache against RetroInfer-style's, by length:** "
        + ", ".join(f"{tokens(n)} {cache[n]:.1f} %" for n in ns)
        + f" (paper: {p_ratio:.1f} % at {tokens(ref)}, {paper.TAB6_MEAN_RATIO_PERCENT} % on average). Eq. 12's "
        "N_p by length: "
        + ", ".join(f"{tokens(n)} {plans[n]['n_p']}" for n in ns)
        + "; persistent heads: "
        + ", ".join(f"{tokens(n)} {plans[n]['persistent_heads']}" for n in ns)
        + "."
    ]
    if at:
        parts, heads = at["parts_gb"], plans[ref]["persistent_heads"]
        per_head = parts["persistent"] / heads
        room = (paper.TAB6_GB["clo"] - parts["slots"]) / per_head
        out.append(
            f"- At {tokens(ref)} the persistent heads hold {parts['persistent']:.2f} GB and the slots "
            f"{parts['slots']:.2f} GB. The paper's CLO, {paper.TAB6_GB['clo']} GB, would leave room beside our "
            f"slots for at most {room:.0f} persistent heads of {per_head:.4f} GB; ours has {heads}."
        )
        out.append(
            f"- RetroInfer-style's cache at {tokens(ref)}: the paper's {paper.TAB6_GB['retroinfer']:.2f} GB, "
            f"ours {rows['retroinfer', ref]['cache_gb']:.2f} GB."
        )
    met = [tokens(n) for n in ns if cache[n] <= TARGET_PERCENT]
    out.append(
        f"- The target (CLO's cache <= {TARGET_PERCENT} % of RetroInfer-style's at every length): "
        + (f"met at {', '.join(met)}" if met else "met nowhere")
        + (" only." if met and len(met) < len(ns) else ".")
    )
    return "\n".join(out)


def blocks(folder: Path) -> dict[str, str]:
    d = tab6_memory.data(folder)
    return {
        "how": how(d),
        "table": compact_source(tab6_memory.table(folder, folder.name)),
        "findings": findings(d),
    }
