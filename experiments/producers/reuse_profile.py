"""Token-level reuse profile of a real model's decode: what a synthetic query process must reproduce so that a
workload at paper shapes does not favour one system (docs/workloads.md, "Query process").

experiments/producers/profile.py measures only the head-level quantity CLO's policy reads: the adjacent-step cosine of a
head's query. A block cache (RetroInfer-style) lives on token-level reuse, and CLO's speculative path lives on
how close the one-layer-ahead query is to the real one. Over a greedy decode with real weights, per decode step,
layer and KV head, with the exact top-k of the prompt's middle (the shared budget rule of
kvoffload/offload/budget.py; scores summed over the query group of q . k, as ExactRetriever):

  query_cos          cos(q_t, q_{t-lag}), each query head's, mean over the KV head's group      (lag 1: s_hat)
  topk_overlap       |S_t & S_{t-lag}| / k, S_t the exact top-k of the real query at step t
  spec_query_cos     cos(q_spec_t, q_t): the speculative query (docs/systems.md; RoPE(W_Q^l RMSNorm_l(x_{l-1})),
                     made from layer l-1's input, what the decoder hands to prepare(l, .)) against layer l's query
  spec_topk_overlap  |S_spec_t & S_t| / k, S_spec_t the exact top-k of the speculative query

Layer 0 has no speculative query (its spec_* entries are null). Dense layers are measured like the others.
Per KV head: mean, std and the 10/50/90% quantiles over steps (and batch); per layer: mean and median over its
heads' samples; `lags` holds the lag-n means of the first two. `s_hat` repeats query_cos's lag-1 mean, so the
file also reads as a reuse profile (clo.policy.persistent.load_profile). Writes data/profiles/<model>-reuse.json
(or +reuse_out=PATH) and refuses an existing file unless force=true.

    python -m experiments.producers.reuse_profile seqlen=7680 workload.gen_tokens=64 workload.stop_at_eos=false \\
        [+reuse.topk_ratio=0.1 +reuse.sink=16 +reuse.recent=64] [+reuse_out=...] [force=true]
"""

from __future__ import annotations

import math
import sys
import time
from collections import deque
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from baselines.fullattn import FullAttn
from experiments.producers.profile import decode_real
from experiments.runner import run_settings
from experiments.runner.records import environment, git_commit
from kvoffload.errors import ConfigError
from kvoffload.model.config import ModelConfig
from kvoffload.offload.budget import select_budget, split_prompt
from kvoffload.offload.retrieval import ExactRetriever, select_topk
from kvoffload.paths import ROOT, repo_path, write_json_atomic

# The budget every sparse system shares by default (conf/system/clo.yaml, retroinfer.yaml): top-k 10 % of the
# prompt with the sink and recent window counted in it.
BUDGET = {"topk_ratio": 0.1, "sink": 16, "recent": 64}
LAGS = (1, 2, 4, 8)
METRICS = ("query_cos", "topk_overlap", "spec_query_cos", "spec_topk_overlap")
QUANTILES = (0.1, 0.5, 0.9)


def topk_overlap(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Index sets a, b [..., k] (each row without repeats) -> |a & b| / k per row [...]."""
    if a.shape != b.shape:
        raise ValueError(f"top-k sets of different shapes {tuple(a.shape)} and {tuple(b.shape)}")
    size = int(torch.maximum(a.max(), b.max())) + 1 if a.numel() else 1
    mask = torch.zeros(*a.shape[:-1], size, dtype=torch.bool).scatter_(-1, a.long(), True)
    return mask.gather(-1, b.long()).float().mean(-1)


def group_cosine(a: torch.Tensor, b: torch.Tensor, group: int) -> torch.Tensor:
    """a, b [B, H, D] -> cos(a_j, b_j) of each query head, mean over each KV head's group: [B, Hkv]."""
    return torch.nn.functional.cosine_similarity(a, b, dim=-1).unflatten(-1, (-1, group)).mean(-1)


class ReuseProbe(FullAttn):
    """FullAttn (so the decoded tokens are FullAttn's) that asks for the speculative query and, at every decode
    step of every layer, records the metrics of METRICS per KV head against the exact top-k of the prompt's middle.
    samples[metric][lag][layer]: one [B, Hkv] tensor per step it was defined at (lag 0 for the spec_* metrics)."""

    wants_speculative_query = True

    def __init__(self, model_cfg: ModelConfig, prompt_len: int, budget: dict, lags=LAGS, keep_queries: bool = False):
        super().__init__()
        self.sink, self.recent, self.n_mid = split_prompt(prompt_len, budget["sink"], budget["recent"])
        self.k_sel = select_budget(prompt_len, budget["topk_ratio"], budget["sink"], budget["recent"])
        if not 0 < self.k_sel < self.n_mid:
            raise ConfigError(
                f"top-k {self.k_sel} of a middle of {self.n_mid} tokens: nothing to select; a longer seqlen"
            )
        self.group, self.lags = model_cfg.group_size, tuple(sorted(lags))
        self.exact = ExactRetriever(
            model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim, torch.device("cpu")
        )
        self.heads = torch.arange(model_cfg.num_kv_heads)
        L = model_cfg.num_layers
        self.samples = {
            m: {lag: [[] for _ in range(L)] for lag in (self.lags if m in METRICS[:2] else (0,))} for m in METRICS
        }
        self.history = [deque(maxlen=self.lags[-1]) for _ in range(L)]  # (q, top-k) of the last steps
        self.q_spec: dict[int, torch.Tensor] = {}
        self.queries = [[] for _ in range(L)] if keep_queries else None  # (q, q_spec) per step, for tests

    def prefill(self, layer, k, v):
        super().prefill(layer, k, v)
        self.exact.index(layer, k[:, :, self.sink : self.sink + self.n_mid].float().cpu().clone())

    def prepare(self, layer, q_spec):
        self.q_spec[layer] = q_spec.float().cpu().clone()

    def decode(self, layer, q, k, v):
        self.observe(layer, q.float().cpu().clone(), self.q_spec.pop(layer, None))
        return super().decode(layer, q, k, v)

    def topk(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """The exact top-k of q over the middle: indices [B, Hkv, k] relative to the middle's start."""
        return select_topk(self.exact.scores(layer, q, self.heads), self.k_sel, 0, method="torch")

    def observe(self, layer: int, q: torch.Tensor, q_spec: torch.Tensor | None) -> None:
        sel, s = self.topk(layer, q), self.samples
        hist = self.history[layer]
        for lag in self.lags:
            if len(hist) >= lag:
                q_prev, sel_prev = hist[-lag]
                s["query_cos"][lag][layer].append(group_cosine(q, q_prev, self.group))
                s["topk_overlap"][lag][layer].append(topk_overlap(sel_prev, sel))
        if q_spec is not None:
            s["spec_query_cos"][0][layer].append(group_cosine(q_spec, q, self.group))
            s["spec_topk_overlap"][0][layer].append(topk_overlap(self.topk(layer, q_spec), sel))
        hist.append((q, sel))
        if self.queries is not None:
            self.queries[layer].append((q, q_spec))


def _json(x: torch.Tensor) -> list:
    """A tensor as nested lists of 5-decimal floats, NaN (no sample) as null."""
    if x.dim() > 1:
        return [_json(row) for row in x]
    return [None if math.isnan(v) else round(v, 5) for v in x.tolist()]


def summarise(per_layer: list[list[torch.Tensor]], num_kv_heads: int) -> dict:
    """per_layer[layer]: [B, Hkv] per step -> per KV head mean/std/quantiles ([L][Hkv], null where a layer has no
    sample) and per layer mean/median over all its samples ([L])."""
    L = len(per_layer)
    nan = torch.full((num_kv_heads,), float("nan"))
    stacks = [torch.cat(steps).double() if steps else None for steps in per_layer]  # [samples, Hkv]
    head = {"mean": [], "std": [], **{f"q{int(p * 100)}": [] for p in QUANTILES}}
    layer = {"mean": [], "median": []}
    for x in stacks:
        head["mean"].append(x.mean(0) if x is not None else nan)
        head["std"].append(x.std(0, unbiased=False) if x is not None else nan)
        for p in QUANTILES:
            head[f"q{int(p * 100)}"].append(x.quantile(p, dim=0) if x is not None else nan)
        layer["mean"].append(float(x.mean()) if x is not None else float("nan"))
        layer["median"].append(float(x.flatten().median()) if x is not None else float("nan"))
    out = {
        "per_head": {k: _json(torch.stack(rows)) for k, rows in head.items()},
        "per_layer": {k: _json(torch.tensor(v)) for k, v in layer.items()},
    }
    counts = [0 if x is None else x.shape[0] for x in stacks]
    out["samples_per_head"] = max(counts) if counts else 0
    out["layers"] = [i for i in range(L) if counts[i]]
    defined = [x for x in stacks if x is not None]
    allx = torch.cat([x.flatten() for x in defined]) if defined else torch.empty(0)
    out["all_heads"] = (
        {"mean": round(float(allx.mean()), 5), "median": round(float(allx.median()), 5)} if allx.numel() else None
    )
    return out


def budget_of(cfg: DictConfig) -> dict:
    extra = OmegaConf.to_container(cfg.reuse, resolve=True) if cfg.get("reuse") is not None else {}
    unknown = set(extra) - set(BUDGET)
    if unknown:
        raise ConfigError(f"reuse.{min(unknown)}: unknown; valid: {', '.join(BUDGET)}")
    budget = {**BUDGET, **extra}
    budget["topk_ratio"], budget["sink"], budget["recent"] = (
        float(budget["topk_ratio"]),
        int(budget["sink"]),
        int(budget["recent"]),
    )
    return budget


def out_path(cfg: DictConfig) -> Path:
    return repo_path(cfg.get("reuse_out") or f"data/profiles/{cfg.model.name}-reuse.json")


def command_line(cfg: DictConfig) -> str:
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task)
    except ValueError:  # not under @hydra.main (a test composing the config)
        overrides = None
    return "python -m experiments.producers.reuse_profile" + ("" if overrides is None else " " + " ".join(overrides))


def resolved_prompt(desc: str) -> str | None:
    """The prompt kind workload.prompt=auto became, from decode_real's description ('...; needle prompt of ...')."""
    parts = desc.split("; ")
    return parts[1].split(" prompt of")[0] if len(parts) > 1 and " prompt of" in parts[1] else None


def measure(cfg: DictConfig, decode=decode_real) -> dict:
    """decode(cfg, make_kv, min_steps) -> (model_cfg, probe, description): experiments.producers.profile.decode_real,
    which refuses synthetic weights; tests hand in a tiny random model's."""
    budget = budget_of(cfg)
    git = git_commit(ROOT)  # the tree the measurement starts from
    t0 = time.perf_counter()
    model_cfg, probe, desc = decode(
        cfg, lambda model_cfg, prompt_len: ReuseProbe(model_cfg, prompt_len, budget), min_steps=3
    )
    wall = time.perf_counter() - t0
    hkv = model_cfg.num_kv_heads
    metrics = {m: summarise(probe.samples[m][1 if m in METRICS[:2] else 0], hkv) for m in METRICS}
    lags = {
        m: {
            str(lag): {
                "per_head_mean": summarise(probe.samples[m][lag], hkv)["per_head"]["mean"],
                "all_heads_mean": (summarise(probe.samples[m][lag], hkv)["all_heads"] or {}).get("mean"),
            }
            for lag in probe.lags
        }
        for m in METRICS[:2]
    }
    prompt_len = run_settings.parse_tokens(cfg.seqlen)
    return {
        "experiment": "reuse_profile",
        "model": model_cfg.name,
        "source": desc,
        "budget": {
            **budget,
            "k": probe.k_sel,
            "middle_tokens": probe.n_mid,
            "rule": "kvoffload.offload.budget.select_budget; exact scores sum_j q_j . k over the group",
        },
        "decode_steps": len(probe.samples["query_cos"][1][0]) + 1,
        "metrics": metrics,
        "lags": lags,
        "s_hat": metrics["query_cos"]["per_head"]["mean"],
        "provenance": {
            "command": command_line(cfg),
            "weights": desc.split(";")[0],
            "prompt": {
                "kind": str(cfg.workload.prompt),
                "resolved": resolved_prompt(desc),
                "tokens": prompt_len,
                "needle_depth": float(cfg.workload.needle_depth),
                "seed": int(cfg.seed),
                "batch": int(cfg.batch),
            },
            "greedy_tokens": int(cfg.workload.gen_tokens),
            "git": git,
            "wall_s": round(wall, 1),
        },
        "environment": environment(run_settings.resolve_device(cfg.device)),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }


def run(cfg: DictConfig, decode=decode_real) -> tuple[dict, Path]:
    """The command: refuses an existing output unless force=true (before any work), measures, writes atomically."""
    path = out_path(cfg)
    if path.resolve() == (ROOT / "data" / "profiles" / f"{cfg.model.name}.json").resolve():
        raise ConfigError(f"{path} is the tracked reuse profile of experiments.producers.profile: another +reuse_out")
    if path.exists() and not cfg.get("force", False):
        raise ConfigError(f"{path} exists: force=true overwrites it (or +reuse_out=another path)")
    data = measure(cfg, decode)
    write_json_atomic(path, data)
    return data, path


@hydra.main(config_path="../../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        data, path = run(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    for m in METRICS:
        a = data["metrics"][m]["all_heads"]
        print(f"{m:>18}: mean {a['mean']:.3f}, median {a['median']:.3f}")
    print(
        f"k = {data['budget']['k']} of {data['budget']['middle_tokens']} middle tokens, "
        f"{data['decode_steps']} decode steps, {data['provenance']['wall_s']} s -> {path}"
    )


if __name__ == "__main__":
    main()
