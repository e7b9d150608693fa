"""The CLO layer's blocks of results/bench/README.md (plots.bench_readme): one layer part by part and eight layers in
a step's order, from experiments.bench.bench_clo_layer's two records (the defaults, and the pinned plan with
`persist_query=speculative`), every ratio against the pinned run's floors, as the README explains."""

from __future__ import annotations

from pathlib import Path

from plots.markdown import md
from plots.readme_parts import machine
from plots.records import commit_of, read_json, tokens

RUNS = ("clo_layer.json", "clo_layer_np0_speculative.json")
PARTS = (
    ("dense", "dense (norms, projections with RoPE, MLP, the next layer's speculative query)"),
    ("dense.gemvs", "of which the projections alone (five GEMV launches)"),
    ("dense.gemvs_cublas", "the projections with cuBLAS"),
    ("lookup", "lookup + label update"),
    ("retrieval", "retrieval of the cached heads, all scored"),
    ("transfer", "transfer, every cached head missing"),
    ("persistent", "persistent heads' top-k (read in place by attention)"),
    ("attention", "hybrid attention, one split launch over every head + one merge"),
)


def runs(folder: Path) -> list[dict]:
    return [read_json(folder / f) for f in RUNS]


def floors(folder: Path) -> dict:
    """The pinned run's floors: its copy measured the device at its usual rate (the README says why)."""
    return runs(folder)[1]["floors"]


def layer(folder: Path) -> str:
    recs = runs(folder)
    f = floors(folder)
    hit = (
        f["dense_floor_us"]
        + f["speculative_query_floor_us"]
        + f["retrieval_floor_all_hit_us"]
        + f["attention_floor_us"]
    )
    miss = f["transfer_floor_us"]
    x = lambda v, floor: f"{v:.1f} = {v / floor:.2f}x"
    body = [[name] + [f"{r['us'][k]:.1f}" for r in recs] for k, name in PARTS]
    body += [
        ["**layer**, all miss"] + [x(r["us"]["layer_all_miss"], miss) for r in recs],
        ["**layer**, all hit"] + [x(r["us"]["layer_all_hit"], hit) for r in recs],
    ]
    p = [r["pipeline"]["us"] for r in recs]
    pf = recs[1]["pipeline"]["floor_us"]
    for q in ("real", "speculative"):
        for case in ("all_miss", "all_hit"):
            body.append(
                [f"**pipeline** (8 layers, per layer), `persist_query={q}`, {case.replace('_', ' ')}"]
                + [x(u[f"{q}_{case}"], pf[case]) for u in p]
            )
        body.append(
            [f"pipeline, every stream at the default priority, `{q}`, all hit"]
            + [f"{u[f'{q}_default_priority_all_hit']:.1f}" for u in p]
        )
    head = ["part (µs)"] + [f"`{f}` (`persist_query={r['persist_query']}`)" for f, r in zip(RUNS, recs)]
    return md(head, body)


def setup(folder: Path) -> str:
    recs = runs(folder)
    a = recs[0]
    fl = [r["floors"] for r in recs]
    pinned = recs[1]["pipeline"]["floor_us"]
    return (
        f"Commit {commit_of(a)}, {machine(a)}. {tokens(a['seqlen'])}, layer {a['layer']}, {a['weights']}; k = "
        f"{fl[0]['k']} rows per head; the plan: N_p = {a['plan']['n_p']}, {a['plan']['persistent_heads']} persistent "
        f"heads in all; layer {a['layer']} has {fl[0]['cached_heads']} cached heads and {fl[0]['persistent_heads']} "
        f"persistent. Device copy: {fl[0]['hbm_gb_s']:.0f} GB/s in the first run, {fl[1]['hbm_gb_s']:.0f} in the "
        f"pinned run. The pinned run's floors, used for both: all hit {pinned['all_hit']} µs, all miss "
        f"{pinned['all_miss']} µs ({fl[1]['transfer_bytes_all_miss'] / 1e6:.1f} MB over a {fl[1]['link_gb_s']} GB/s "
        f"link); dense {fl[1]['dense_floor_us']} + speculative query {fl[1]['speculative_query_floor_us']} µs, "
        f"attention {fl[1]['attention_floor_us']} µs."
    )


def blocks(folder: Path) -> dict[str, str]:
    return {"layer_setup": setup(folder), "layer": layer(folder)}
