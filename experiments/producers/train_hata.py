"""Learned HATA hash weights (docs/systems.md, "Retrieval"): per layer and KV head, W [head_dim, rbit] such that
sign(q W) and sign(k W) rank a query's keys as q . k does. HATA's recipe (gpzlx1/HATA, our own code): positives are the
top fraction (10 %) of the prompt's middle keys by q . k for each query, summed over the KV head's query group as the
retriever scores them. The sign is relaxed to tanh(beta x) (beta annealed upwards, so that the relaxed codes end close
to the signs the retriever uses), and the loss is listwise: the softmax of the relaxed hash scores
(1 - 2 hamming / rbit) |k|, summed over the group, should put its mass on the positives. W starts from the SimHash
projection HashRetriever draws with the same seed, so training moves the baseline rather than a new draw.

Queries and keys come from greedy decodes of needle prompts with real weights: the keys as prefill hands them to
the KV system (after RoPE), the queries as each decode step does. Writes data/hata/<model>-rbit<rbit>.safetensors
(fp16 [layers, kv_heads, head_dim, rbit]) and its provenance beside it (.json); refuses an existing file unless
force=true.

    python -m experiments.producers.train_hata model=smollm2 seqlen=3k workload.gen_tokens=32 \\
        workload.stop_at_eos=false \\
        [+hata.rbit=256 +hata.steps=120 ...] [+hata_out=PATH] [force=true]
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import hydra
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from baselines.fullattn import FullAttn
from experiments.producers.profile import decode_real
from experiments.runner import cli_checks, run_settings
from experiments.runner.records import environment, git_commit, refuse
from kvoffload.errors import ConfigError
from kvoffload.offload.budget import split_prompt
from kvoffload.offload.retrieval import save_hash_weights, simhash_weights
from kvoffload.paths import ROOT, repo_path, write_json_atomic

# +hata.<key> settings. The training prompts: needle prompts at these (seed, needle depth) pairs; the recall
# measurement (experiments.producers.hata_recall) holds out other seeds and depths.
DEFAULTS = {
    "rbit": 256,
    "init_seed": 0,  # SimHash's seed (conf/system/clo.yaml's seed): the starting point
    "positive_fraction": 0.1,  # HATA: the top 10 % keys by q . k are a query's positives
    "steps": 120,  # optimiser steps per layer
    "lr": 0.02,
    "beta": [1.0, 6.0],  # tanh(beta x) relaxation of the sign, annealed from the first to the second
    "temperature": 0.05,  # of the listwise softmax over the relaxed scores (scaled to [-1, 1])
    "queries_per_step": 16,  # decode steps' queries per optimiser step
    "keys_per_step": 768,  # middle keys per optimiser step (the positives among them count)
    "seeds": [1, 2, 3, 4],
    "depths": [0.2, 0.4, 0.6, 0.8],
    "sink": 16,  # the middle (candidates) of CLO's split: conf/system/clo.yaml's sink and recent
    "recent": 64,
}


class KeyQueryRecorder(FullAttn):
    """FullAttn that keeps every layer's prompt keys (post-RoPE, as prefill hands them over) and each decode step's
    query (batch row 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: dict[int, torch.Tensor] = {}
        self.queries: dict[int, list[torch.Tensor]] = {}

    def prefill(self, layer, k, v):
        super().prefill(layer, k, v)
        self.keys[layer] = k[0].float().cpu().clone()  # [Hkv, T, D]

    def decode(self, layer, q, k, v):
        self.queries.setdefault(layer, []).append(q[0].float().cpu())  # [H, D]
        return super().decode(layer, q, k, v)


def settings(cfg: DictConfig, defaults: dict, section: str) -> dict:
    extra = OmegaConf.to_container(cfg[section], resolve=True) if cfg.get(section) is not None else {}
    unknown = set(extra) - set(defaults)
    if unknown:
        raise ConfigError(f"{section}.{min(unknown)}: unknown; valid: {', '.join(defaults)}")
    out = {**defaults, **extra}
    if len(out["seeds"]) != len(out["depths"]):
        raise ConfigError(f"{section}.seeds and {section}.depths pair up: give as many of each")
    return out


def capture(cfg: DictConfig, prompts: list[tuple[int, float]], decode=decode_real):
    """Greedy decodes of needle prompts (seed, needle depth) -> (model_cfg, samples, descriptions); a sample is
    (keys {layer: [Hkv, T, D]}, queries {layer: [S, H, D]})."""
    samples, descs, model_cfg = [], [], None
    for seed, depth in prompts:
        c = cfg.copy()
        c.seed, c.workload.needle_depth = int(seed), float(depth)
        model_cfg, rec, desc = decode(c, lambda m, t: KeyQueryRecorder(), min_steps=3)
        samples.append((rec.keys, {layer: torch.stack(q) for layer, q in rec.queries.items()}))
        descs.append(f"seed {seed}, needle depth {depth}: {desc}")
    return model_cfg, samples, descs


def relaxed_scores(w: torch.Tensor, q: torch.Tensor, k: torch.Tensor, beta: float) -> torch.Tensor:
    """HashRetriever's score with tanh(beta x) for sign(x), over unit q and k (a code is scale-free) and unit
    columns of W (so beta alone sets how sharp the relaxation is): w [Hkv, D, R], q [Hkv, S, G, D], k [Hkv, T, D]
    -> sum_g <c(q_g), c(k)> / R * |k| / (G max|k|) [Hkv, S, T], in [-1, 1]."""
    wn = F.normalize(w, dim=1) * beta * math.sqrt(w.shape[1])  # unit x . unit column is ~ N(0, 1 / D)
    cq = torch.tanh(torch.einsum("hsgd,hdr->hsgr", F.normalize(q, dim=-1), wn))
    ck = torch.tanh(torch.einsum("htd,hdr->htr", F.normalize(k, dim=-1), wn))
    norm = k.norm(dim=-1)
    s = torch.einsum("hsr,htr->hst", cq.sum(2), ck) / w.shape[-1]
    return s * (norm / norm.amax(-1, keepdim=True))[:, None] / q.shape[2]


def positives(q: torch.Tensor, k: torch.Tensor, fraction: float) -> torch.Tensor:
    """[Hkv, S, T] bool: each query's top `fraction` of the keys by sum_g q_g . k (ExactRetriever's score)."""
    exact = torch.einsum("hsgd,htd->hst", q, k)
    n = max(1, round(fraction * k.shape[1]))
    return torch.zeros_like(exact, dtype=torch.bool).scatter_(-1, exact.topk(n, -1).indices, True)


def listwise_loss(scores: torch.Tensor, pos: torch.Tensor, temperature: float) -> torch.Tensor:
    """Cross-entropy of the softmax over a query's keys against the uniform distribution over its positives."""
    logp = torch.log_softmax(scores / temperature, -1)
    return -(logp * pos).sum(-1).div(pos.sum(-1).clamp_min(1)).mean()


def train_layer(data: list[tuple[torch.Tensor, torch.Tensor]], w0: torch.Tensor, s: dict, gen: torch.Generator):
    """data: per prompt (q [Hkv, S, G, D], k [Hkv, T, D]) of one layer; w0 [Hkv, D, R] -> (W, first and last
    losses). Each step takes one prompt (round robin) and `queries_per_step` of its queries at random."""
    w = w0.clone().requires_grad_(True)
    opt = torch.optim.Adam([w], lr=s["lr"])
    pos = [positives(q, k, s["positive_fraction"]) for q, k in data]
    b0, b1 = s["beta"]
    losses = []
    for step in range(s["steps"]):
        beta = b0 * (b1 / b0) ** (step / max(1, s["steps"] - 1))  # geometric: sharpen slowly, then fast
        i = step % len(data)
        q, k = data[i]
        # a sample of the queries, and of the keys (sampled softmax: encoding every key dominates a step's cost)
        qi = torch.randperm(q.shape[1], generator=gen)[: s["queries_per_step"]]
        ki = torch.randperm(k.shape[1], generator=gen)[: s["keys_per_step"]]
        p = pos[i][:, qi][:, :, ki]
        loss = listwise_loss(relaxed_scores(w, q[:, qi], k[:, ki], beta), p, s["temperature"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    n = max(1, len(data))  # one pass over the prompts, averaged
    return F.normalize(w.detach(), dim=1), sum(losses[:n]) / n, sum(losses[-n:]) / n


def layer_data(samples, layer: int, group: int, sink: int, recent: int):
    """Per prompt: (queries [Hkv, S, G, D], middle keys [Hkv, T_mid, D]) of one layer."""
    out = []
    for keys, queries in samples:
        k = keys[layer]
        lo, _, n_mid = split_prompt(k.shape[1], sink, recent)
        q = queries[layer]  # [S, H, D]
        q = q.unflatten(1, (k.shape[0], group)).permute(1, 0, 2, 3)  # [Hkv, S, G, D]
        out.append((q.contiguous(), k[:, lo : lo + n_mid].contiguous()))
    return out


def out_path(cfg: DictConfig, rbit: int) -> Path:
    return repo_path(cfg.get("hata_out") or f"data/hata/{cfg.model.name}-rbit{rbit}.safetensors")


def command_line(cfg: DictConfig, module: str) -> str:
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task)
    except ValueError:  # not under @hydra.main (a test composing the config)
        overrides = []
    return " ".join([f"python -m experiments.{module}", *overrides])


def run(cfg: DictConfig, decode=decode_real) -> tuple[dict, Path]:
    s = settings(cfg, DEFAULTS, "hata")
    if s["rbit"] <= 0 or s["rbit"] % 8:
        raise ConfigError(f"hata.rbit={s['rbit']} must be a positive multiple of 8")
    path = out_path(cfg, s["rbit"])
    if path.exists() and run_settings.switch(cfg.force, "force") is not True:
        raise ConfigError(f"{path} exists: force=true overwrites it (or +hata_out=another path)")
    git = git_commit(ROOT)  # the tree the training starts from
    t0 = time.perf_counter()
    model_cfg, samples, descs = capture(cfg, list(zip(s["seeds"], s["depths"])), decode)
    t_capture = time.perf_counter() - t0
    L, hkv, d = model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim
    w0 = simhash_weights(L, hkv, d, s["rbit"], s["init_seed"])
    gen = torch.Generator().manual_seed(s["init_seed"])
    weights, loss = [], []
    for layer in range(L):
        data = layer_data(samples, layer, model_cfg.group_size, s["sink"], s["recent"])
        w, first, last = train_layer(data, w0[layer], s, gen)
        weights.append(w)
        loss.append([round(first, 4), round(last, 4)])
        print(f"layer {layer:2d}: loss {first:.4f} -> {last:.4f}", file=sys.stderr, flush=True)
    weights = torch.stack(weights).half()
    record = {
        "experiment": "train_hata",
        "model": model_cfg.name,
        "shape": list(weights.shape),
        "settings": s,
        "prompts": descs,
        "loss_first_last_per_layer": loss,
        "wall_s": {"capture": round(t_capture, 1), "train": round(time.perf_counter() - t0 - t_capture, 1)},
        "provenance": {"command": command_line(cfg, "train_hata"), "git": git},
        "environment": environment(torch.device("cpu")),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    save_hash_weights(
        path, weights, {"model": model_cfg.name, "source": f"experiments.producers.train_hata ({path.stem})"}
    )
    write_json_atomic(path.with_suffix(".json"), record)
    return record, path


@hydra.main(config_path="../../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        record, path = run(cfg)
    except ConfigError as e:
        refuse(e)
    print(f"hash weights {tuple(record['shape'])} in {sum(record['wall_s'].values()):.0f} s -> {path}")


if __name__ == "__main__":
    cli_checks.refuse_unknown_keys(extra=("hata", "hata_out"))
    main()
