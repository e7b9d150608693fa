"""The generated blocks of results/gpu_smoke_llama3/README.md (plots.readmes): FullAttn's eager and graph smoke
runs (one table each, from the run records), the machine, the copy bandwidth the floors used and the GPU tests' tally
from the pytest logs beside them."""

from __future__ import annotations

from pathlib import Path

from plots.markdown import md, span
from plots.readme_parts import machine, pytest_summary
from plots.records import commit_of, load_records, tokens


def runs(folder: Path) -> list[dict]:
    return load_records(folder, allow_mixed=True).rows


def phases_on(rec: dict) -> bool:
    # graph-era records say whether their phases were timed; the eager ones only carry the setting
    return bool(rec["phases_timed"] if rec.get("phases_timed") is not None else rec["config"].get("profile_phases"))


def cells(m: dict) -> list[str]:
    return [
        f"{m['decode_ms_per_step']:.2f}",
        f"{m['dense_floor_ms_per_step']:.2f}",
        f"{m['step_over_floor']:.2f}",
        f"{m['decode_tokens_per_s']:.1f}",
    ]


def setup(folder: Path) -> str:
    xs = [r["record"] for r in runs(folder)]
    one = lambda f: ", ".join(sorted({str(f(x)) for x in xs}))
    wl = lambda key: one(lambda x: x["config"]["workload"][key])
    return (
        f"Weights: {one(lambda x: x['weights'])}, at {one(lambda x: x['model'])} shapes. Prompt: "
        f"`workload.prompt={one(lambda x: x['prompt']['kind'])}`, {wl('gen_tokens')} "
        f"generated tokens, the first {wl('warmup_steps')} decode steps left out "
        "of the means."
    )


def eager(folder: Path) -> str:
    rs = runs(folder / "eager")
    rows = sorted(
        (r["record"] for r in rs),
        key=lambda x: (x["seqlen"], phases_on(x), x["config"]["system"]["attention_backend"] != "flashinfer"),
    )
    body = [
        [tokens(x["seqlen"]), x["config"]["system"]["attention_backend"], "on" if phases_on(x) else "off"]
        + cells(x["metrics"])
        for x in rows
    ]
    head = ["seqlen", "attention", "phase events", "ms/step", "floor ms", "x floor", "tok/s"]
    commits = sorted({commit_of(x) for x in rows})
    return f"Commit {', '.join(commits)}; {machines(rows)}.\n\n" + md(head, body)


def eager_findings(folder: Path) -> str:
    rows = [r["record"] for r in runs(folder / "eager")]
    by_len: dict[int, list[float]] = {}
    for x in rows:
        by_len.setdefault(x["seqlen"], []).append(x["metrics"]["decode_ms_per_step"])
    short, long = min(by_len), max(by_len)
    return (
        f"The {tokens(long)} run steps in {span(by_len[long], '{:.1f}', ' ms')}, the {tokens(short)} runs in "
        f"{span(by_len[short], '{:.1f}', ' ms')} (four settings of one workload, "
        f"{max(by_len[short]) / min(by_len[short]):.2f}x apart)."
    )


def graph(folder: Path) -> str:
    rs = runs(folder / "graph")
    rows = sorted(rs, key=lambda r: (r["record"].get("decode_mode") != "graph", r["record"]["batch"], r["file"]))
    body = []
    for r in rows:
        x = r["record"]
        att = x["metrics"]["phase_ms_per_step"].get("attention") if x.get("phases_timed") else None
        body.append(
            [tokens(x["seqlen"]), str(x["batch"]), x.get("decode_mode", "eager")]
            + cells(x["metrics"])
            + ["-" if att is None else f"{att:.2f}", f"`graph/{r['file']}`", commit_of(x)]
        )
    head = ["seqlen", "batch", "decode", "ms/step", "floor ms", "x floor", "tok/s", "attention ms", "record", "commit"]
    xs = [r["record"] for r in rs]
    bw = [x["metrics"]["bandwidth_gb_s"] / 1000 for x in xs]
    return (
        f"{machines(xs)}.\n\n"
        + md(head, body)
        + f"\n\nThe copy bandwidth the floors use, measured in each run: {span(bw, unit=' TB/s')}. "
        + "'attention ms': where the run timed its phases."
    )


def machines(recs: list[dict]) -> str:
    return "; ".join(sorted({machine(x) for x in recs}))


def tests(folder: Path) -> str:
    return (
        "; ".join(f"`{p.relative_to(folder)}`: {pytest_summary(p)}" for p in sorted(folder.glob("*/pytest_gpu.log")))
        + "."
    )


def blocks(folder: Path) -> dict[str, str]:
    return {
        "setup": setup(folder),
        "eager": eager(folder),
        "eager_findings": eager_findings(folder),
        "graph": graph(folder),
        "tests": tests(folder),
    }
