"""Markdown for the tables that every figure module's table() writes (results/REPORT.md, the results READMEs): a
pipe table, a number with one decimal, and the line naming the record files and commit a table came from."""

from __future__ import annotations


def md(header: list[str], rows: list[list]) -> str:
    cell = lambda v: "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


def f1(x: float | None, unit: str = "") -> str | None:
    return None if x is None else f"{x:.1f}{unit}"


def source(folder: str, recs) -> str:
    return f"Records: {', '.join(f'`{folder}/{f}`' for f in recs.files)} (commit {recs.commit})."
