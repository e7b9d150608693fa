"""The generated blocks of results/fig4_6_similarity_smollm2/README.md (plots.readmes): the run, what the record
holds and the table of adjacent-step similarity, from plots.fig4_6_similarity's reading of the record, and the same
model's other measurements (the reuse profile's record, the tracked profile) for comparison."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvoffload.paths import repo_path
from plots import fig4_6_similarity, paper
from plots.readme_parts import commit, machine
from plots.records import read_json


def record(folder: Path) -> tuple[dict, dict]:
    d = fig4_6_similarity.data(folder)
    return d, d["records"].rows[0]["record"]


def run(folder: Path) -> str:
    d, rec = record(folder)
    cfg, prov = rec["config"], rec["provenance"]
    wl = cfg["workload"]
    dirty = "dirty tree" if prov["git"].get("dirty") else "clean tree"
    return (
        f"- {commit(rec).capitalize()}, {dirty}; {machine(rec)}; {prov['wall_s']} s of measurement; `run.log`.\n"
        f"- Prompt: `workload.prompt={wl['prompt']}`, seqlen {cfg['seqlen']}, pass key at depth {wl['needle_depth']}, "
        f"batch {cfg['batch']}, seed {cfg['seed']}; {wl['gen_tokens']} greedy tokens = {rec['decode_steps']} decode "
        f"steps = {d['steps']} adjacent-step pairs per head."
    )


def contents(folder: Path) -> str:
    d, rec = record(folder)
    s, b = rec["shape"], rec["budget"]
    return (
        f"`{d['records'].files[0]}`: `query_cos[layer][query head][pair]`, the cosine of each of the "
        f"{s['layers'] * s['heads']} query heads' query with its own query one step earlier ({s['layers']} layers x "
        f"{s['heads']} heads x {d['steps']} pairs); `topk_overlap[layer][KV head][pair]`, |S_t & S_t-1| / k of each "
        f"KV head's exact top-k of the prompt's middle (k = {b['k']} of {b['middle_tokens']} middle tokens: top-k "
        f"ratio {b['topk_ratio']} with sink {b['sink']} and recent {b['recent']}, scores summed over the query group)."
    )


def table(folder: Path) -> str:
    d, _ = record(folder)
    cut = paper.FIG4_6_COSINE
    cos, hm, ov = d["cos"], d["head_mean"], d["overlap"]
    layer = cos.mean(axis=(1, 2))
    low = [i for i, v in enumerate(layer) if v < cut]
    above = int((hm > cut).sum())
    rows = [
        f"| samples (step x query head) with cosine > {cut} | {d['above']:.1%} | {paper.FIG4_6} |",
        f"| query heads whose mean cosine > {cut} | {d['heads_above']:.1%} ({above} of {hm.size}) | |",
        f"| mean / median cosine | {cos.mean():.3f} / {np.median(cos):.3f} | |",
        f"| per-layer mean | {layer.min():.3f} (layer {layer.argmin()}) to {layer.max():.3f} (layer {layer.argmax()})"
        + (f"; layers {', '.join(map(str, low))} below {cut}" if low else "")
        + " | |",
        f"| mean / median top-k overlap, adjacent steps | {ov.mean():.3f} / {np.median(ov):.3f} | |",
    ]
    return "| quantity | here | paper |\n|---|---|---|\n" + "\n".join(rows)


def others(folder: Path) -> str:
    """The same quantities where the model's other measurements have them."""
    d, _ = record(folder)
    out = []
    reuse = repo_path(f"results/reuse_profile_{d['model']}/record.json")
    if reuse.is_file():
        r = read_json(reuse)
        m = r["metrics"]
        out.append(
            f"`../reuse_profile_{d['model']}/` ({r['provenance']['prompt']['tokens']} tokens, group means per KV head) "
            f"has mean cosine {m['query_cos']['all_heads']['mean']:.3f} and top-k overlap "
            f"{m['topk_overlap']['all_heads']['mean']:.3f}"
        )
    prof = repo_path(f"data/profiles/{d['model']}.json")
    if prof.is_file():
        p = read_json(prof)
        out.append(f"`data/profiles/{d['model']}.json` ({p['source'].split('; ')[-1]}) mean {np.mean(p['s_hat']):.3f}")
    return "Against the other measurements of this model: " + "; ".join(out) + "." if out else ""


def blocks(folder: Path) -> dict[str, str]:
    return {"run": run(folder), "contents": contents(folder), "table": table(folder), "others": others(folder)}
