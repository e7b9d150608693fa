"""The generated blocks of results/accuracy_smollm2/README.md (plots.readmes): the lm-eval runs of FullAttn and CLO
(scores by plots.tab5_accuracy's reading), how their samples' scores and responses differ, CLO's plan, and the
records' cost per sample."""

from __future__ import annotations

from pathlib import Path

from plots import tab5_accuracy
from plots.markdown import span
from plots.readme_parts import commit, machine
from plots.records import SYSTEMS, tokens

ORDER = ("fullattn", "clo")


def load(folder: Path) -> tuple[dict, dict[str, dict]]:
    d = tab5_accuracy.data(folder)
    return d, {r["record"]["system"]: r["record"] for r in d["records"]}


def samples(rec: dict) -> dict[tuple[str, int], dict]:
    """(task, doc id) -> sample, over every length a task ran at."""
    return {
        (task, s["doc_id"]): s
        for task, by_len in rec["tasks"].items()
        for cell in by_len.values()
        for s in cell["samples"]
    }


def run(d: dict, recs: dict) -> str:
    any_rec = recs[ORDER[0]]
    env = any_rec["environment"]
    n = {t: cell["n"] for t, by_len in any_rec["tasks"].items() for cell in by_len.values()}
    prompt = any_rec["cost_per_sample"]["prompt_tokens"]
    wall = sum(c["wall_s"] for r in recs.values() for by_len in r["tasks"].values() for c in by_len.values())
    return (
        f"{commit(any_rec).capitalize()}; {machine(any_rec)}, lm-eval {env.get('lm_eval')}. Weights: "
        f"{any_rec['weights']}. Tasks: "
        + ", ".join(f"`{t}` ({k} samples)" for t, k in n.items())
        + f"; the prompts are {prompt:.0f} tokens on average. The tasks' wall time over both jobs: "
        f"{wall // 60:.0f} min {wall % 60:.0f} s."
    )


def plan(recs: dict) -> str:
    st = recs["clo"]["system_state"]
    p = st["plan"]
    return (
        f"CLO's plan on this machine: {p['persistent_heads']} persistent heads, {p['prefetch_heads']} prefetched, "
        f"{p['demoted_heads']} demoted (`n_p` {p['n_p']}, from the measured {st['layer_time_ms']:.2f} ms layer time; "
        f"`system_state` in its record). Its hash: {st['retriever']}."
    )


def scores(d: dict, recs: dict) -> str:
    cols = [SYSTEMS[s] for s in ORDER]
    lines = ["| task | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for task in d["tasks"]:
        name, _, length = task.partition("@")
        label = f"`{name}` @ {tokens(int(length))}" if length else f"`{name}`"
        lines.append(
            f"| {label} | " + " | ".join(f"{d['scores'][(recs[s]['model'], s)][task]:.2f}" for s in ORDER) + " |"
        )
    return "\n".join(lines)


def differences(recs: dict) -> str:
    a, b = samples(recs["fullattn"]), samples(recs["clo"])
    out = []
    for task in sorted({t for t, _ in a}):
        scored = {
            s: [x["score"] for (t, _), x in samples(recs[s]).items() if t == task and x["score"] > 0] for s in ORDER
        }
        n = sum(1 for t, _ in a if t == task)
        differ = sum(1 for k in a if k[0] == task and a[k]["response"] != b.get(k, {}).get("response"))
        out.append(
            f"- `{task}`: "
            + "; ".join(
                f"{SYSTEMS[s]} scores on {len(v)} of {n} samples"
                + (f" ({', '.join(f'{x:g}' for x in v)})" if v else "")
                for s, v in scored.items()
            )
            + f"; the responses differ in {differ} of {n}."
        )
    total = {s: sum(x["cost"]["new_tokens"] for x in samples(recs[s]).values()) for s in ORDER}
    out.append("- Tokens generated in all: " + ", ".join(f"{SYSTEMS[s]} {total[s]}" for s in ORDER) + ".")
    cut = [
        (k, a[k]["cost"]["new_tokens"], b[k]["cost"]["new_tokens"])
        for k in a
        if k in b and a[k]["cost"]["new_tokens"] != b[k]["cost"]["new_tokens"]
    ]
    out += [f"- `{t}` sample {i}: FullAttn {x} tokens, CLO {y}." for (t, i), x, y in cut]
    return "\n".join(out)


def cost(recs: dict) -> str:
    c = {s: recs[s]["cost_per_sample"] for s in ORDER}
    cache = {s: recs[s]["prefill_cache"] for s in ORDER}

    def prefill(s: str) -> str:
        if c[s]["prefill_s"] is not None:
            return f"{c[s]['prefill_s']:.1f} s, computed ({c[s]['prefills_computed']} of {c[s]['samples']})"
        return f"shared: FullAttn's prefills reused ({cache[s]['hits']} of {c[s]['samples']} hits)"

    def decode(s: str) -> str:
        hit = f", hit rate {c[s]['hit_rate']:.2f}" if c[s]["hit_rate"] is not None else ""
        return f"{c[s]['decode_s']:.1f} s ({c[s]['new_tokens']} tokens, {c[s]['decode_ms_per_step']:.0f} ms/step{hit})"

    rows = [
        (f"prefill (dense, {c['fullattn']['prompt_tokens']:.0f} tokens)", prefill),
        ("handing the prompt's K/V to the system", lambda s: f"{c[s]['load_s']:.2f} s"),
        ("decode", decode),
        ("system total (hand-over + decode)", lambda s: f"{c[s]['system_s']:.1f} s"),
    ]
    loads = [v for r in recs.values() for w in r["environment"]["load_average"].values() for v in w]
    ratio = c["clo"]["decode_ms_per_step"] / c["fullattn"]["decode_ms_per_step"]
    return (
        f"Means over the {c['fullattn']['samples']} samples:\n\n| | "
        + " | ".join(SYSTEMS[s] for s in ORDER)
        + " |\n|---|---|---|\n"
        + "\n".join(f"| {name} | " + " | ".join(f(s) for s in ORDER) + " |" for name, f in rows)
        + f"\n\nLoad averages in the records: {span(loads, '{:.1f}')} on {recs['clo']['environment']['cpu_count']} "
        f"cores. CLO's step is {ratio:.1f}x FullAttn's here."
    )


def blocks(folder: Path) -> dict[str, str]:
    d, recs = load(folder)
    return {
        "run": run(d, recs),
        "plan": plan(recs),
        "scores": scores(d, recs),
        "differences": differences(recs),
        "cost": cost(recs),
    }
