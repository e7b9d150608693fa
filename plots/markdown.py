"""Markdown for the tables that every figure module's table() writes (results/REPORT.md, the results READMEs): a
pipe table, a number with one decimal, and the line naming the record files and commit a table came from."""

from __future__ import annotations

import re


def md(header: list[str], rows: list[list]) -> str:
    cell = lambda v: "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


def f1(x: float | None, unit: str = "") -> str | None:
    return None if x is None else f"{x:.1f}{unit}"


def source(folder: str, recs) -> str:
    return f"Records: {', '.join(f'`{folder}/{f}`' for f in recs.files)} (commit {recs.commit})."


def compact_source(text: str) -> str:
    """A table's closing 'Records: `a`, `b`, ... (commit c).' as a count: a README sits beside its records."""
    return re.sub(
        r"Records: ((?:`[^`]+`(?:, )?)+) \(commit ([^()]+(?: \(dirty\))?)\)\.",
        lambda m: f"Records: {files_here(m[1].count('`') // 2)} (commit {m[2]}).",
        text,
    )


def files_here(n: int) -> str:
    return "the one file here" if n == 1 else f"the {n} files here"


def span(xs, fmt: str = "{:.2f}", unit: str = "") -> str:
    """'lo-hi' of the values (one value where both print alike), each formatted by fmt, then the unit."""
    lo, hi = min(xs), max(xs)
    return (fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}") + unit


def decode_setup(recs) -> str:
    """The settings a set of decode records share, as a README states them: weights, prompt, steps, batch, queries,
    the systems' retrieval defaults, and where they ran (commit, device)."""
    first = recs[0]["record"] if isinstance(recs, list) else next(iter(recs))["record"]
    rows = [r["record"] for r in recs]
    w, s, env = first["config"]["workload"], first["config"]["system"], first["environment"]
    depths = sorted({r["config"]["workload"].get("needle_depth") for r in rows})
    prompt = (
        f"needle prompt of {first['seqlen']} tokens (pass key at depth {' and '.join(map(str, depths))})"
        if w["prompt"] == "needle"
        else f"{w['prompt']} prompt of {first['seqlen']} tokens"
    )
    found = [r["answer"]["found"] for r in rows if (r.get("answer") or {}).get("found") is not None]
    where = env.get("gpu") or f"a {env['cpu_count']}-core CPU"
    commits = sorted({(r["environment"]["git"]["commit"] or "")[:7] for r in rows})
    out = (
        f"{first['weights'][0].upper()}{first['weights'][1:]}; {prompt}; {w['gen_tokens']} greedy steps"
        + ("" if w.get("stop_at_eos") else " without stopping at EOS")
        + f" (the first {w['warmup_steps']} left out), batch {first['batch']}, {first['query_process']}; "
        f"top-k {s['topk_ratio']:.0%}, {s['retriever']} retrieval (rbit {s['rbit']}), {s['dense_layers']} dense "
        f"layers. Commit {', '.join(commits)}, {where}."
    )
    if found:
        out += f" The needle was found in {sum(found)} of {len(found)} runs."
    return out
