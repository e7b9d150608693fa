"""The generated blocks of results/ablation_cpu/README.md and results/ablation_gpu_128k/README.md
(plots.readmes): the runs' settings, a row per +T/+G/+P variant from plots.ablation's reading of the records, and
what changes from one variant to the next, beside the paper's reductions (plots.paper) on the GPU."""

from __future__ import annotations

from pathlib import Path

from plots import ablation, paper
from plots.markdown import decode_setup, md
from plots.records import commit_of, tokens


def sparse_heads(rec: dict) -> int:
    """The KV heads of the sparse layers (every layer but the dense ones): the heads a plan can make persistent."""
    m = rec["config"]["model"]
    return (m["num_layers"] - rec["config"]["system"]["dense_layers"]) * m["num_kv_heads"]


def heads(r: dict) -> str:
    return f"{r['persistent_heads'] or 0} / {r['prefetch_heads'] or 0}"


def gain(d: dict, a: str, b: str) -> tuple[float, float]:
    """Hit-rate points and the share of link bytes that variant b gains over a."""
    va, vb = d["variants"][a], d["variants"][b]
    return 100 * (vb["hit_rate"] - va["hit_rate"]), 100 * (1 - vb["mb_per_step"] / va["mb_per_step"])


def cpu_blocks(folder: Path) -> dict[str, str]:
    d = ablation.data(folder)
    by = {ablation.variant(r["record"]): r["record"] for r in d["records"]}
    n = sparse_heads(by["base"])
    rows = [
        [ablation.LABELS[v], f"{r['hit_rate'] * 100:.1f}%", f"{r['mb_per_step']:.2f} MB", heads(r)]
        for v, r in d["variants"].items()
    ]
    table = md(
        ["variant", "hit rate (cached heads)", "host->device per step", f"persistent / prefetch heads (of {n} sparse)"],
        rows,
    )
    v = d["variants"]
    same = v["t"]["hit_rate"] == v["base"]["hit_rate"] and v["t"]["mb_per_step"] == v["base"]["mb_per_step"]
    pts, cut = gain(d, "t", "tg")
    tgp = by["tgp"]
    plan = tgp["system_state"]["plan"]
    findings = [
        f"- +T against base: {'the same hit rate and bytes' if same else 'a different hit rate or bytes'}.",
        f"- +G against +T: the hit rate {pts:+.1f} points, the bytes moved {-cut:+.0f} %.",
        f"- +P's plan: a layer of {tgp['system_state']['layer_time_ms']:.2f} ms, a link of "
        f"{tgp['system_state']['link_gb_s']} GB/s, N_p {plan['n_p']}: {plan['persistent_heads']} persistent and "
        f"{plan['prefetch_heads']} prefetch heads of the {n} sparse; {v['tgp']['mb_per_step']:.1f} MB a step.",
    ]
    return {"setup": decode_setup(d["records"]), "table": table, "findings": "\n".join(findings)}


def gpu_blocks(folder: Path) -> dict[str, str]:
    d = ablation.data(folder)
    by = {ablation.variant(r["record"]): r["record"] for r in d["records"]}
    rows = []
    for v, r in d["variants"].items():
        m = by[v]["metrics"]
        rows.append(
            [
                ablation.LABELS[v],
                f"{r['ms_per_step']:.2f}",
                "-" if v == "base" else f"{r['vs_base_percent']:.1f}%",
                f"-{paper.ABLATION_REDUCTION_PERCENT[v]}%" if v in paper.ABLATION_REDUCTION_PERCENT else "-",
                f"{r['hit_rate']:.3f}",
                f"{r['mb_per_step']:.0f}",
                f"{m['system_floor_ms_per_step']:.2f}",
                f"{m['step_over_system_floor']:.2f}",
                heads(r),
            ]
        )
    head = ["variant", "ms/step", "vs base", f"{paper.ABLATION}: vs base", "hit rate", "link MB/step"]
    table = md([*head, "own floor (ms)", "x own floor", "persistent / prefetch heads"], rows)
    v = d["variants"]
    env = by["base"]["environment"]
    setup = (
        f"{by['base']['weights'][0].upper()}{by['base']['weights'][1:]}, {by['base']['config']['workload']['prompt']} "
        f"{tokens(d['seqlen'])} prompt, BSZ {by['base']['batch']}, {by['base']['config']['workload']['gen_tokens']} "
        f"decode steps, `decode_mode` {by['base']['decode_mode']}; commit {commit_of(by['base'])}, {env.get('gpu')}."
    )
    pts, cut = gain(d, "tg", "tgp")
    findings = (
        f"+P against +T +G: {v['tgp']['persistent_heads']} persistent heads, the link bytes {-cut:+.0f} %, the step "
        f"{100 * (v['tgp']['ms_per_step'] / v['tg']['ms_per_step'] - 1):+.0f} %, the hit rate {pts:+.1f} points."
    )
    return {"setup": setup, "table": table, "findings": findings}
