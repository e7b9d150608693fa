"""Top-k recall of learned HATA hash weights against SimHash at the same rbit, on held-out prompts (docs/workloads.md,
"HATA hash weights"). For each layer at or above CLO's dense layers, KV head and decode step of greedy decodes with
real weights (needle prompts at other seeds and depths than experiments.producers.train_hata's, and a random-token
prompt out of distribution), against the exact top-k of the real query over the prompt's middle (CLO's sink/recent/top-k
split, sum_j q_j . k over the query group, as ExactRetriever):

  recall  |S & S*| / k     S = the hash retriever's top-k (HashRetriever itself: sign codes, packed, popcount)
  mass    the softmax attention over the middle that S covers (group mean); the exact top-k's is the ceiling

and the same of PQCache's product quantisation (`pq`: kvoffload/offload/pq_index.py, its default 2 sub-vectors x 64
centroids; its top-k ranks by the group's summed softmax, not by sum_j q_j . k, so its recall is of another order).

Writes results/hata_<model>/record.json (or +recall_out=PATH).

    python -m experiments.producers.hata_recall model=smollm2 seqlen=3k workload.gen_tokens=32 \\
        workload.stop_at_eos=false \\
        [+recall.weights=[data/hata/smollm2-rbit256.safetensors,...]] [+recall_out=PATH]
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from experiments.producers.profile import decode_real
from experiments.producers.train_hata import capture, command_line, layer_data, settings
from experiments.runner import cli_checks, run_settings
from experiments.runner.records import environment, git_commit, refuse
from kvoffload.errors import ConfigError
from kvoffload.offload.budget import select_budget
from kvoffload.offload.pq_index import PQRetriever
from kvoffload.offload.retrieval import ExactRetriever, HashRetriever, load_hash_weights, select_topk, simhash_weights
from kvoffload.paths import ROOT, repo_path, write_json_atomic

DEFAULTS = {
    "weights": ["data/hata/smollm2-rbit256.safetensors"],  # each compared with SimHash at its rbit
    "simhash_seed": 0,
    "seeds": [101, 102, 103],  # held out: experiments.producers.train_hata trains on 1-4 at depths 0.2-0.8
    "depths": [0.1, 0.5, 0.9],
    "random_prompt": True,  # also a random-token prompt (seed 104): far from the training prompts
    "topk_ratio": 0.1,  # CLO's budget (conf/system/clo.yaml)
    "sink": 16,
    "recent": 64,
    "dense_layers": 2,
    "pq": True,  # also PQCache's product-quantisation retriever
}


# decode steps scored at once: HashRetriever's CPU reference expands [steps, Hkv, G, T, rbit / 8] int64 temporaries
STEP_CHUNK = 8


def recall_and_mass(retriever, exact: ExactRetriever, layer: int, q: torch.Tensor, k_sel: int) -> torch.Tensor:
    """q [S, H, D] (decode steps' queries as a batch) against the layer's indexed middle (a batch of S identical
    rows) -> [S, Hkv, 2]: each step and KV head's recall and covered attention mass."""
    keys = exact.keys[layer]  # [S, Hkv, T, D]
    s, hkv, _, d = keys.shape
    heads = torch.arange(hkv)
    best = select_topk(exact.scores(layer, q, heads), k_sel, 0, method="torch")
    got = select_topk(retriever.scores(layer, q, heads), k_sel, 0, method="torch")
    mask = torch.zeros(s, hkv, keys.shape[2], dtype=torch.bool).scatter_(-1, best, True)
    logits = torch.einsum("skgd,sktd->skgt", q.view(s, hkv, -1, d), keys)
    attn = torch.softmax(logits / math.sqrt(d), -1).mean(2)  # the group's mean, over the middle
    return torch.stack([mask.gather(-1, got).float().mean(-1), attn.gather(-1, got).sum(-1)], -1)


def evaluate(samples, model_cfg, weights: dict[str, torch.Tensor | str | None], s: dict) -> dict:
    """weights: name -> W [L, Hkv, D, rbit] for a HashRetriever, "pq" for a PQRetriever, None for the exact top-k
    (the ceiling) ->
    name -> {"recall": [per layer], "mass": [per layer]} over the layers from dense_layers on, each the mean over
    prompts, steps and KV heads."""
    L, hkv, d, g = model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim, model_cfg.group_size
    cpu = torch.device("cpu")
    out = {name: {"recall": [], "mass": []} for name in weights}
    for layer in range(min(s["dense_layers"], L), L):
        per = {name: [] for name in weights}
        for q, k_mid in layer_data(samples, layer, g, s["sink"], s["recent"]):
            k_sel = select_budget(k_mid.shape[1] + s["sink"] + s["recent"], s["topk_ratio"], s["sink"], s["recent"])
            q_steps = q.permute(1, 0, 2, 3).flatten(1, 2)  # [S, H, D], the heads in the model's order
            for lo in range(0, q_steps.shape[0], STEP_CHUNK):
                qs = q_steps[lo : lo + STEP_CHUNK]
                rows = k_mid[None].expand(qs.shape[0], -1, -1, -1)
                exact = ExactRetriever(L, hkv, d, cpu)
                exact.index(layer, rows)
                for name, w in weights.items():
                    r = exact
                    if isinstance(w, str):
                        r = PQRetriever(L, hkv, d, cpu)
                    elif w is not None:
                        r = HashRetriever(L, hkv, d, cpu, w.shape[-1], weights=w, weights_source=name)
                    if r is not exact:
                        r.index(layer, rows)
                    per[name].append(recall_and_mass(r, exact, layer, qs, k_sel))
        for name, vals in per.items():
            mean = torch.cat(vals).mean((0, 1))
            out[name]["recall"].append(round(float(mean[0]), 4))
            out[name]["mass"].append(round(float(mean[1]), 4))
    return out


def measure(cfg: DictConfig, decode=decode_real) -> dict:
    s = settings(cfg, DEFAULTS, "recall")
    git = git_commit(ROOT)
    t0 = time.perf_counter()
    prompts = list(zip(s["seeds"], s["depths"]))
    model_cfg, samples, descs = capture(cfg, prompts, decode)
    if s["random_prompt"]:
        c = cfg.copy()
        c.workload.prompt = "random"
        _, more, more_descs = capture(c, [(104, 0.5)], decode)
        samples, descs = samples + more, descs + more_descs
    t_capture = time.perf_counter() - t0
    L, hkv, d = model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim
    weights: dict[str, torch.Tensor | str | None] = {"exact": None}
    for path in s["weights"]:
        w, _ = load_hash_weights(path, L, hkv, d, None)
        weights[f"learned_rbit{w.shape[-1]}"] = w
        weights[f"simhash_rbit{w.shape[-1]}"] = simhash_weights(L, hkv, d, w.shape[-1], s["simhash_seed"])
    if s["pq"]:
        weights["pq"] = "pq"
    per_prompt = [evaluate([sample], model_cfg, weights, s) for sample in samples]
    groups = {"needle_held_out": per_prompt[: len(prompts)], "random_tokens": per_prompt[len(prompts) :]}

    def per_layer(results: list[dict], name: str, m: str) -> list[float]:
        return [round(sum(x) / len(x), 4) for x in zip(*(r[name][m] for r in results))]

    summary = {
        group: {
            name: {m: round(sum(v := per_layer(results, name, m)) / len(v), 4) for m in ("recall", "mass")}
            for name in weights
        }
        for group, results in groups.items()
        if results
    }
    return {
        "experiment": "hata_recall",
        "model": model_cfg.name,
        "settings": s,
        "layers": f"{min(s['dense_layers'], L)}..{L - 1}",
        "prompts": descs,
        "summary": summary,
        "per_layer": {
            group: {name: {m: per_layer(results, name, m) for m in ("recall", "mass")} for name in weights}
            for group, results in groups.items()
            if results
        },
        "wall_s": {"capture": round(t_capture, 1), "score": round(time.perf_counter() - t0 - t_capture, 1)},
        "provenance": {"command": command_line(cfg, "hata_recall"), "git": git},
        "environment": environment(torch.device("cpu")),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }


def out_path(cfg: DictConfig) -> Path:
    return repo_path(cfg.get("recall_out") or f"results/hata_{cfg.model.name}/record.json")


@hydra.main(config_path="../../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        path = out_path(cfg)
        if path.exists() and run_settings.switch(cfg.force, "force") is not True:
            raise ConfigError(f"{path} exists: force=true overwrites it (or +recall_out=another path)")
        data = measure(cfg)
    except ConfigError as e:
        refuse(e)
    write_json_atomic(path, data)
    for group, rows in data["summary"].items():
        for name, vals in rows.items():
            print(f"{group:>16} {name:>16}: recall {vals['recall']:.4f}, mass {vals['mass']:.4f}")
    # the README beside it is prose around blocks that plots.readmes fills from this record
    print(f"-> {path}; its README: python -m plots.readmes")


if __name__ == "__main__":
    cli_checks.refuse_unknown_keys(extra=("recall", "recall_out"))
    main()
