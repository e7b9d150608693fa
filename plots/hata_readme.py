"""The generated blocks of results/hata_<model>/README.md (plots.readmes): the run of
experiments.producers.hata_recall that wrote record.json (its command, commit, machine and times), the budget it
scored under, each prompt group's recall and mass of learned HATA hashes, SimHash and PQ, and the prompts."""

from __future__ import annotations

from pathlib import Path

from plots.readme_parts import commit, machine
from plots.records import load_files


def record(folder: Path) -> dict:
    return load_files(
        folder, "record.json", lambda r: r.get("experiment") == "hata_recall", "HATA recall records"
    ).rows[0]["record"]


def run(data: dict) -> str:
    prov_dirty = data["provenance"]["git"].get("dirty")
    env_dirty = (data["environment"].get("git") or {}).get("dirty")
    says = commit(data).capitalize()
    if prov_dirty is not None and bool(prov_dirty) != bool(env_dirty):
        # the two were read at different moments of the run: say both rather than pick one
        says = f"{says.replace(' (dirty tree)', '')} ({'dirty' if env_dirty else 'clean'} tree by the record's "
        says += f"environment, {'dirty' if prov_dirty else 'clean'} by its provenance)"
    return (
        f"    {data['provenance']['command']}\n\n"
        f"{says}; {machine(data)}; {data['environment']['platform']}; capture "
        f"{data['wall_s']['capture']} s, scoring {data['wall_s']['score']} s."
    )


def budget(data: dict) -> str:
    s = data["settings"]
    return (
        f"Layers {data['layers']} (the first {s['dense_layers']} stay dense); k = CLO's budget at top-k ratio "
        f"{s['topk_ratio']}, sink {s['sink']}, recent {s['recent']}; SimHash seed {s['simhash_seed']}; learned "
        f"weights {', '.join(f'`{w}`' for w in s['weights'])}."
    )


def tables(data: dict) -> str:
    """Each prompt group's table of recall and mass, and learned minus SimHash at each rbit."""
    lines: list[str] = []
    for group, rows in data["summary"].items():
        lines += [f"**{group}**", "", "| hashes | recall | mass |", "|---|---|---|"]
        lines += [f"| {name} | {v['recall']:.4f} | {v['mass']:.4f} |" for name, v in rows.items()]
        for rbit in sorted({n.split("rbit")[1] for n in rows if "rbit" in n}, key=int):
            learned, simhash = rows[f"learned_rbit{rbit}"], rows[f"simhash_rbit{rbit}"]
            lines.append(
                f"\nrbit {rbit}: learned - SimHash = {learned['recall'] - simhash['recall']:+.4f} recall, "
                f"{learned['mass'] - simhash['mass']:+.4f} mass."
            )
        lines.append("")
    return "\n".join(lines)


def blocks(folder: Path) -> dict[str, str]:
    data = record(folder)
    return {
        "run": run(data),
        "budget": budget(data),
        "tables": tables(data),
        "prompts": "\n".join(f"- {p}" for p in data["prompts"]),
    }
