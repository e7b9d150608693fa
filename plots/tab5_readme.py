"""The generated blocks of results/tab5_accuracy/README.md and results/tab5_ablation/README.md (plots.readmes):
the per-cell scores, the means over the cells every system scored, each sparse system's gap to FullAttn with its
paired interval, CLO's real hit rate per length, and the cost per sample; the ablation's variants against FullAttn.
The prose around them is the READMEs' own; every number here comes from a record."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

from plots import paper, tab5_ablation, tab5_accuracy
from plots.records import SYSTEMS, NoRecords, commit_of, tokens

ORDER = ("fullattn", "clo", "retroinfer", "infinigen")


def cell_name(cell: str) -> str:
    task, length = cell.split("@")
    return f"`{task}` @ {tokens(int(length))}"


def hit_rates(records) -> dict[int, list[float]]:
    """{length: [the hit rate of each record scoring that length]} over accuracy records that report one."""
    out: dict[int, list[float]] = {}
    for r in records:
        hit = r["record"]["cost_per_sample"].get("hit_rate")
        for by_length in r["record"]["tasks"].values():
            for length in by_length:
                if hit is not None:
                    out.setdefault(int(length), []).append(hit)
    return out


def slowest_prefill(records) -> str:
    """The longest prefill a record computed, against the median of its cell's: a sweep paused mid-prefill (SIGSTOP
    while other work had the cores) shows here, and its excess is what the cost above holds of the pause."""
    worst = None
    for r in records:
        for task, by_length in r["record"]["tasks"].items():
            for length, cell in by_length.items():
                own = [x["cost"] for x in cell["samples"] if not x["cost"].get("prefill_shared")]
                ps = [c["prefill_s"] for c in own if c.get("prefill_s") is not None]
                if ps and (worst is None or max(ps) > worst[0]):
                    worst = (max(ps), statistics.median(ps), task, int(length), commit_of(r["record"]))
    if worst is None:
        return ""
    top, med, task, length, commit = worst
    return (
        f"The longest prefill: `{task}` @ {tokens(length)} at {commit}, {top:.0f} s against its cell's median "
        f"{med:.1f} s; {(top - med) / 3600:.2f} h of the prefills' cost above is that one prefill's excess."
    )


def sample_scores(records, name=lambda rec: rec["system"]) -> dict[tuple[str, str], dict[int, float]]:
    """{(name, cell): {doc_id: score}} from the records' samples (a cell is <task>@<tokens>, as in the table); the
    name is the record's system, or what `name` makes of the record (an ablation's variant)."""
    out: dict[tuple[str, str], dict[int, float]] = {}
    for r in records:
        rec = r["record"]
        for task, by_length in rec["tasks"].items():
            for length, cell in by_length.items():
                out[name(rec), f"{task}@{length}"] = {x["doc_id"]: float(x["score"]) for x in cell["samples"]}
    return out


def paired_interval(samples, system: str, cells: list[str], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95 % percentile interval of FullAttn's mean over the cells minus the system's (points), by a paired bootstrap:
    each draw resamples every cell's samples (the documents the system scored, which FullAttn scored too: it may
    have scored more) with replacement."""
    pairs = []
    for c in cells:
        ref, mine = samples["fullattn", c], samples[system, c]
        if not set(mine) <= set(ref):
            raise SystemExit(f"error: {system} scored samples of {c} that FullAttn did not")
        pairs.append([ref[i] - mine[i] for i in sorted(mine)])
    rng, stats = random.Random(seed), []
    for _ in range(draws):
        stats.append(100 * statistics.fmean(statistics.fmean(rng.choices(p, k=len(p))) for p in pairs))
    stats.sort()
    return stats[int(0.025 * draws)], stats[int(0.975 * draws) - 1]


def table_blocks(folder: Path) -> dict[str, str]:
    d = tab5_accuracy.data(folder)
    model = "smollm2"
    systems = [s for s in ORDER if (model, s) in d["scores"]]
    scores = {s: d["scores"][(model, s)] for s in systems}
    cells = sorted(set.intersection(*(set(v) for v in scores.values())), key=lambda c: (int(c.split("@")[1]), c))
    lengths = sorted({int(c.split("@")[1]) for c in cells})
    commit = {c: d["commits"][(model, c)] for c in cells}
    by_commit = {k: sum(1 for c in cells if commit[c] == k) for k in sorted(set(commit.values()))}
    out: dict[str, str] = {}
    lines = [f"{len(cells)} complete cells; commit " + ", ".join(f"{k} ({n})" for k, n in by_commit.items())]
    lines[-1] += ": every system of a cell ran at its commit (column `commit`).\n"
    samples = sample_scores(d["records"])
    room = tab5_accuracy.headroom_cells(d["scores"], model)
    lines += ["| task (samples) | " + " | ".join(SYSTEMS[s] for s in systems) + " | commit | headroom |"]
    lines += ["|---" * (len(systems) + 3) + "|"]

    def mean(s, cs):
        return statistics.fmean(scores[s][c] for c in cs)

    for length in lengths:
        mine = [c for c in cells if int(c.split("@")[1]) == length]
        lines += [
            f"| {cell_name(c)} ({len(samples['fullattn', c])}) | "
            + " | ".join(f"{scores[s][c]:.3f}" for s in systems)
            + f" | {commit[c]} | {'yes' if c in room else 'no headroom'} |"
            for c in mine
        ]
        means = " | ".join(f"{mean(s, mine):.3f}" for s in systems)
        lines += [f"| mean @ {tokens(length)} ({len(mine)} tasks) | {means} | | |"]
    means = " | ".join(f"**{mean(s, cells):.3f}**" for s in systems)
    lines += [f"| **mean of the {len(cells)} cells** | {means} | | |"]
    out["cells"], lines = "\n".join(lines), []
    for s in systems[1:]:
        per = ", ".join(
            f"{tokens(n)} {100 * (mean('fullattn', m) - mean(s, m)):.1f}"
            for n in lengths
            for m in [[c for c in cells if int(c.split("@")[1]) == n]]
        )
        lo, hi = paired_interval(samples, s, cells)
        gap = 100 * (mean("fullattn", cells) - mean(s, cells))
        lines += [f"- {SYSTEMS[s]}: {gap:.1f}, interval {lo:.1f} to {hi:.1f} ({per})"]
    out["gaps"], lines = "\n".join(lines), []
    with_room = [c for c in cells if c in room]
    lines += [f"Over the {len(with_room)} cells with headroom only (FullAttn scores at least"]
    lines[-1] += f" {tab5_accuracy.HEADROOM}; in the other {len(cells) - len(with_room)} every system is at the floor"
    lines[-1] += " and a gap there is noise), the same measure:"
    lines += [""]
    for s in systems[1:] if with_room else []:
        lo, hi = paired_interval(samples, s, with_room)
        gap = 100 * (mean("fullattn", with_room) - mean(s, with_room))
        lines += [f"- {SYSTEMS[s]}: {gap:.1f}, interval {lo:.1f} to {hi:.1f}"]
    out["headroom"] = "\n".join(lines)
    hits = hit_rates(r for r in d["records"] if r["record"]["system"] == "clo")
    lo, hi = paper.TAB4_HIT_RATE_PERCENT["clo"]
    out["hit_rate"] = f"CLO's real hit rate per length (mean over its records; {paper.TAB4}: {lo}-{hi} %): "
    out["hit_rate"] += ", ".join(f"{tokens(n)} {statistics.fmean(v):.3f}" for n, v in sorted(hits.items())) + "."
    costs = [r["record"]["cost_per_sample"] for r in d["records"]]
    prefill_h = sum(c["prefills_computed"] * (c["prefill_s"] or 0) for c in costs) / 3600
    system_h = sum(c["samples"] * c["system_s"] for c in costs) / 3600
    lines = [f"The records here cost {prefill_h + system_h:.1f} h of one thread: {prefill_h:.1f} h of prefills"]
    lines += [f"(each prompt's, shared by the systems of its cell) and {system_h:.1f} h in the systems (the"]
    lines += ["target: the whole table in 3 h of a 2-core machine). Per sample, means over the records:", ""]
    lines += ["| system | commit | records | decode ms/step | system s/sample |", "|---|---|---|---|---|"]
    for s in systems:
        for k in sorted(d["records"].commits):
            mine = [
                r["record"]["cost_per_sample"]
                for r in d["records"]
                if r["record"]["system"] == s and commit_of(r["record"]) == k
            ]
            if mine:
                ms = statistics.fmean(c["decode_ms_per_step"] for c in mine)
                sys_s = statistics.fmean(c["system_s"] for c in mine)
                lines += [f"| {SYSTEMS[s]} | {k} | {len(mine)} | {ms:.0f} | {sys_s:.1f} |"]
    out["cost"] = "\n".join([*lines, "", slowest_prefill(d["records"])]).rstrip("\n")
    return out


def ablation_blocks(folder: Path, table: Path | None = None) -> dict[str, str]:
    """The ablation's blocks; its FullAttn from the Table 5 folder beside it unless table names another."""
    d = tab5_ablation.data(folder)
    table = table or folder.parent / "tab5_accuracy"
    cells = "Cells scored by every variant, each at the commit its variants ran at: "
    cells += ", ".join(f"{cell_name(c)} ({d['commits'][c]})" for c in d["cells"]) + "."
    lines = []
    try:
        t = tab5_accuracy.data(table)
        full, samples = t["scores"].get(("smollm2", "fullattn"), {}), sample_scores(t["records"])
    except NoRecords:
        full, samples = {}, {}
    ref = all(c in full for c in d["cells"])
    samples.update(sample_scores(d["records"], tab5_ablation.variant_of))
    head = " points below FullAttn | 95 % paired interval |" if ref else ""
    lines += ["| variant | mean score | real hit rate |" + head, "|---|---|---|" + ("---|---|" if ref else "")]
    # FullAttn on the documents the variants scored (its own cells may hold more)
    docs = {c: samples[next(iter(d["means"])), c] for c in d["cells"]}
    fa = (
        statistics.fmean(statistics.fmean(samples["fullattn", c][i] for i in docs[c]) for c in d["cells"])
        if ref
        else None
    )
    for v, m in d["means"].items():
        hit = d["hit_rate"].get(v)
        row = f"| `{v}` | {m:.3f} | {hit:.3f} |" if hit is not None else f"| `{v}` | {m:.3f} | - |"
        if ref:
            lo, hi = paired_interval(samples, v, d["cells"])
            row += f" {100 * (fa - m):.1f} | {lo:.1f} to {hi:.1f} |"
        lines += [row]
    if any(d["hit_rate"].get(v) is None for v in d["means"]):
        lines += ["", "A hit rate `-`: the variant looked nothing up in a cache (`nocache`, or a plan with every head"]
        lines += ["a prefetch head, as eta 0.9 makes on SmolLM2: its record's `system_state.plan`)."]
    if ref:
        lines += ["", f"FullAttn's mean over the same cells and documents is {fa:.3f} (`../tab5_accuracy/`, its own"]
        lines += ["commit); the interval is the paired bootstrap of `../tab5_accuracy/README.md` over those documents."]
    missing = {v: cs for v, cs in d["missing"].items() if cs}
    if missing:
        lines += ["", "Cells some variants have not run yet: "]
        lines[-1] += "; ".join(f"{v}: {', '.join(cell_name(c) for c in cs)}" for v, cs in missing.items()) + "."
    return {"cells": cells, "variants": "\n".join(lines)}
