"""The generated blocks of results/key_profile_<model>/README.md (plots.readmes): the run of
experiments.producers.key_profile, the key geometry and the queries' energy along the keys' principal directions
(from the record and the key profile it wrote beside the model's data), the adjacent-step overlaps of real and
synthetic queries on real and synthetic keys, and what they show."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvoffload.paths import repo_path
from plots.markdown import span
from plots.readme_parts import commit, machine
from plots.records import load_files, read_json

DENSE = 2  # the systems' dense layers: the record's overlaps and the quantities below leave them out
QUERIES = {
    "real": "real",
    "process_real_q0": "process, real q0",
    "process_random_q0": "process, random q0",
    "process_aligned_q0": "process, key-aligned q0",
    "process_group_q0": "process, group q0",
}
KEYS = {
    "real_keys": "real",
    "isotropic_keys": "isotropic",
    "iid_process_keys": "iid process",
    "process_keys": "process",
}


def load(folder: Path) -> tuple[dict, dict]:
    """The record and the key profile it wrote (data/profiles/<model>-keys.json), its per-head fields as arrays."""
    rec = load_files(folder, "record.json", lambda r: r.get("experiment") == "key_profile", "key profile records")
    rec = rec.rows[0]["record"]
    prof = read_json(repo_path(f"data/profiles/{rec['model']}-keys.json"))
    return rec, {k: np.array(v) for k, v in prof.items() if isinstance(v, list)}


def run(rec: dict) -> str:
    b = rec["budget"]
    return (
        f"    {rec['provenance']['command']}\n\n"
        f"{commit(rec).capitalize()}; {machine(rec)}; {rec['wall_s']} s to load, prefill and decode. Weights and "
        f"prompt: {rec['source']} ({rec['decode_steps']} decode-step queries). The prompt's middle: "
        f"{b['middle_tokens']} tokens (sink {b['sink']} and recent {b['recent']} left out); top-k ratio "
        f"{b['topk_ratio']}, k = {b['k']}; RetroInfer-style blocks of {b['block']} tokens (top k/{b['block']} "
        f"blocks). Query process: `{rec['query_process']}`."
    )


def geometry(rec: dict, p: dict) -> str:
    s, eig = rec["summary"], p["eig"]
    part = eig.sum(-1) ** 2 / (eig**2).sum(-1)
    rows = [
        ("mean ratio \\|E k\\| / sqrt(E \\|k\\|^2)", s["mean_ratio"], "{:.3f}"),
        ("top eigenvalue share of the centred covariance", s["top1_eig_share"], "{:.3f}"),
        (f"top 8 of {eig.shape[-1]} eigenvalues' share", s["top8_eig_share"], "{:.3f}"),
        (
            f"participation ratio (effective dimensions, of {eig.shape[-1]})",
            {"mean": part.mean(), "min": part.min(), "max": part.max()},
            "{:.1f}",
        ),
    ]
    top = {n: eig[..., :n].sum(-1).mean() for n in (8, 32)}
    return (
        f"{eig.shape[0] * eig.shape[1]} KV heads.\n\n| quantity | mean | min | max |\n|---|---|---|---|\n"
        + "\n".join(f"| {q} | " + " | ".join(f.format(v[k]) for k in ("mean", "min", "max")) + " |" for q, v, f in rows)
        + f"\n\nAbout {s['mean_ratio']['mean'] ** 2:.0%} of the keys' energy ({s['mean_ratio']['mean']:.3f}^2) is one "
        f"common direction; the rest has a steep spectrum (top 8 directions {top[8]:.0%}, top 32 {top[32]:.0%})."
    )


def energy(rec: dict, p: dict) -> str:
    eig, qe = p["eig"], p["query_energy"]
    st, fl = (np.array(rec["per_head"][k]) for k in ("steady_query_energy", "fluct_query_energy"))
    d = eig.shape[-1]
    head = (
        "| directions | keys' variance | queries | queries' steady part (mean over steps) | fluctuation | isotropic |"
    )
    lines = [head, "|---|---|---|---|---|---|"]
    for n in (1, 8, 32):
        vals = [x[..., :n].sum(-1).mean() for x in (eig, qe, st, fl)] + [n / d]
        lines.append(f"| top {n} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    s = rec["summary"]
    return "\n".join(lines) + (
        f"\n\nTop 8: queries {s['query_energy_top8']['mean']:.2f} against {s['isotropic_top8']} isotropic, the steady "
        f"part {s['steady_query_energy_top8']['mean']:.2f}; top 32: queries {qe[..., :32].sum(-1).mean():.2f} against "
        f"{32 / d:.3f}."
    )


def overlap(rec: dict, key: str) -> str:
    s = rec["summary"][key]
    lines = ["| queries \\ keys | " + " | ".join(KEYS.values()) + " |", "|---|" + "---|" * len(KEYS)]
    lines += [f"| {name} | " + " | ".join(f"{s[f'{q}/{k}']:.3f}" for k in KEYS) + " |" for q, name in QUERIES.items()]
    return "\n".join(lines)


def findings(rec: dict, p: dict) -> str:
    t, b = rec["summary"]["topk_overlap_layers_2+"], rec["summary"]["block_overlap_layers_2+"]
    gc, tc = p["group_cos"], p["token_corr"][DENSE:]
    group = [t[f"process_group_q0/{k}"] for k in KEYS]
    q = lambda x: "-".join(f"{v:.2f}" for v in np.quantile(x, [0.1, 0.9]))
    return "\n".join(
        [
            f"- Token overlap: real queries {t['real/real_keys']:.3f} on real keys, {t['real/isotropic_keys']:.3f} on "
            f"isotropic ones; the process started key-aligned {t['process_aligned_q0/process_keys']:.3f} against "
            f"{t['process_random_q0/process_keys']:.3f} started at random (both on process keys).",
            f"- Group coherence: mean pairwise cosine of a KV head's query heads (`group_cos`) {gc.mean():.2f}, "
            f"10-90 % over heads {q(gc)}. The process started from the real first query overlaps "
            f"{t['process_real_q0/real_keys']:.3f} on real keys, from a random one "
            f"{t['process_random_q0/real_keys']:.3f}; a first query drawn with the measured coherence gives "
            f"{span(group, '{:.3f}')}.",
            f"- Token correlation: adjacent tokens' centred scores correlate (`token_corr`) {tc.mean():.2f} on layers "
            f"{DENSE}+, 10-90 % {q(tc)}. Block overlap with the real queries: {b['real/real_keys']:.3f} on real keys, "
            f"{span([b['real/isotropic_keys'], b['real/iid_process_keys']], '{:.3f}')} on isotropic or "
            f"token-independent keys, {b['real/process_keys']:.3f} on the process's correlated keys.",
            f"- The key process with both (group q0 on process keys): {t['process_group_q0/process_keys']:.3f} token "
            f"and {b['process_group_q0/process_keys']:.3f} block overlap, against the real "
            f"{t['real/real_keys']:.3f} and {b['real/real_keys']:.3f}.",
        ]
    )


def blocks(folder: Path) -> dict[str, str]:
    rec, p = load(folder)
    return {
        "run": run(rec),
        "geometry": geometry(rec, p),
        "energy": energy(rec, p),
        "topk": overlap(rec, "topk_overlap_layers_2+"),
        "block": overlap(rec, "block_overlap_layers_2+"),
        "findings": findings(rec, p),
    }
