"""The generated blocks of results/speculative_selection_<model>/README.md (plots.readmes): the run of
experiments.producers.speculative_selection, its table of recall and covered attention mass by selecting query and
scorer over the hard heads, and what selecting with the speculative query costs, from its record."""

from __future__ import annotations

from pathlib import Path

from plots.readme_parts import commit, machine
from plots.records import load_files

COLUMNS = {
    "hash_real": "hash, real query",
    "hash_speculative": "hash, speculative query",
    "exact_speculative": "exact, speculative",
    "exact_real": "exact, real",
}


def record(folder: Path) -> dict:
    recs = load_files(folder, "record.json", lambda r: r.get("experiment") == "speculative_selection", "records")
    return recs.rows[0]["record"]


def run(rec: dict) -> str:
    first, last = (int(x) for x in rec["layers"].split(".."))
    sparse = (last - first + 1) * len(rec["hard"][0])
    return (
        f"- Weights and prompt: {rec['source']}; {commit(rec)}; {machine(rec)}.\n"
        f"- Selection: k = {rec['k']} of {rec['middle_tokens']} middle tokens; the hash: {rec['retriever']}, rbit "
        f"{rec['rbit']}; layers {rec['layers']}; {rec['steps_per_head']} decode steps scored per head.\n"
        f"- Hard heads (Eq. 11): {rec['hard_heads']} of the {sparse} sparse heads."
    )


def table(rec: dict) -> str:
    s = rec["summary"]["hard_heads"]
    lines = [
        f"| means over the {rec['hard_heads']} hard heads | " + " | ".join(COLUMNS.values()) + " |",
        "|---|" + "---|" * len(COLUMNS),
    ]
    for m, name in (
        ("recall", "recall of the real query's exact top-k"),
        ("mass", "attention mass of the middle covered"),
    ):
        lines.append(f"| {name} | " + " | ".join(f"{s[f'{m}_{c}']:.3f}" for c in COLUMNS) + " |")
    return "\n".join(lines)


def findings(rec: dict) -> str:
    hard, other = rec["summary"]["hard_heads"], rec["summary"]["other_heads"]
    cost = hard["mass_hash_real"] - hard["mass_hash_speculative"]
    hashing = hard["mass_exact_real"] - hard["mass_hash_real"]
    first, last = (int(x) for x in rec["layers"].split(".."))
    n_other = (last - first + 1) * len(rec["hard"][0]) - rec["hard_heads"]
    return (
        f"Selecting with the speculative query costs {100 * cost:.1f} points of covered attention mass "
        f"({cost / hard['mass_hash_real']:.1%} of it) with the hash scores; the hash itself costs "
        f"{100 * hashing:.0f} points against the exact top-k. The other {n_other} heads: "
        f"{other['mass_hash_real']:.3f} -> {other['mass_hash_speculative']:.3f}."
    )


def blocks(folder: Path) -> dict[str, str]:
    rec = record(folder)
    return {"run": run(rec), "table": table(rec), "findings": findings(rec)}
