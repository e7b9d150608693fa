"""CLO's plan: everything it decides before the first token, from its settings, the shapes and the runner's
measurements (flashinfer's plan / run split). `make_plan` reads the profile and importance tables (and checks the
learned hash weights' shapes) and nothing else: no device, no allocation, no measurement. The memory estimate and
the allocation read the same plan.

  tau        [layers, kv_heads] reuse thresholds (Eq. 7-9, or eta, or the override)
  importance [layers, kv_heads] head importance (weights of the GQA aggregation, Eq. 10)
  heads      which heads are persistent and which prefetched, per layer (Eq. 11-13); under a device budget
             (KVSpec.gpu_budget_bytes) the persistent heads that do not fit take the cached path instead, the
             least hard first (`fit_budget`)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from clo.config import CLOConfig
from clo.policy.persistent import HeadPlan, heads_per_layer_time, load_profile, plan_persistent_heads
from clo.policy.thresholds import load_importance, thresholds
from kvoffload.errors import ConfigError
from kvoffload.kv.interface import KVSpec, split_host
from kvoffload.offload.budget import select_budget, split_prompt
from kvoffload.offload.retrieval import load_hash_weights, metadata_bytes_per_head

# T_comp when neither the setting nor the runner gives one (unit tests that build a KVSpec by hand)
UNMEASURED_LAYER_S = 1e-4


@dataclass(frozen=True)
class CLOPlan:
    tau: torch.Tensor
    importance: torch.Tensor
    heads: HeadPlan
    layer_time_s: float
    link_bytes_per_s: float
    importance_source: str
    profile_source: str

    def describe(self) -> dict:
        return {
            "importance": self.importance_source,
            "profile": self.profile_source,
            "plan": self.heads.summary(),
            "layer_time_ms": self.layer_time_s * 1e3,
            "link_gb_s": self.link_bytes_per_s / 1e9,
        }


def k_select(cfg: CLOConfig, prompt_len: int) -> int:
    return select_budget(prompt_len, cfg.topk_ratio, cfg.sink, cfg.recent)


def make_plan(cfg: CLOConfig, spec: KVSpec) -> CLOPlan:
    L, hkv = spec.num_layers, spec.num_kv_heads
    if cfg.dense_layers > L:
        raise ConfigError(f"dense_layers={cfg.dense_layers} exceeds the model's {L} layers")
    importance, importance_source = load_importance(cfg.importance, L, hkv)
    # learned hash weights of another model or another rbit are refused here, before any allocation
    if cfg.hash_weights is not None and cfg.retriever == "hash":
        load_hash_weights(cfg.hash_weights, L, hkv, spec.head_dim, cfg.rbit)
    if cfg.threshold_override is not None:
        tau = torch.full((L, hkv), float(cfg.threshold_override))
    elif cfg.adaptive_threshold:
        tau = thresholds(importance, cfg.eta, cfg.n)
    else:
        tau = torch.full((L, hkv), cfg.eta)
    s_hat, profile_source = load_profile(cfg.profile, L, hkv)
    if cfg.link_gb_s is not None and spec.link_cap_gb_s is not None and cfg.link_gb_s > spec.link_cap_gb_s:
        raise ConfigError(
            f"system.link_gb_s={cfg.link_gb_s:g} plans with more than the link's cap, "
            f"hardware.link_gb_s={spec.link_cap_gb_s:g}: pin at most the cap, or null to plan with the cap"
        )
    link = cfg.link_gb_s * 1e9 if cfg.link_gb_s is not None else spec.link_bytes_per_s
    layer_s = cfg.layer_time_ms / 1e3 if cfg.layer_time_ms is not None else spec.layer_time_s or UNMEASURED_LAYER_S
    # mem_head: one head's top-k as the link moves it (host rows: packed FP8 with their scales under kv_dtype=fp8)
    n_p = heads_per_layer_time(layer_s, link, spec.batch * k_select(cfg, spec.max_len) * spec.host_row_bytes)
    if cfg.persistent:
        heads = plan_persistent_heads(tau, s_hat, cfg.epsilon, n_p, skip_layers=cfg.dense_layers)
    else:
        heads = HeadPlan([[] for _ in range(L)], [[] for _ in range(L)], n_p)
    plan = CLOPlan(tau, importance, heads, layer_s, link, importance_source, profile_source)
    return fit_budget(cfg, plan, spec)


def fit_budget(cfg: CLOConfig, plan: CLOPlan, spec: KVSpec) -> CLOPlan:
    """The plan with as few persistent heads demoted to the cached path (miss -> top-k + transfer) as the device
    budget needs, the least hard (lowest Eq. 11 difficulty) first. A plan that fits is returned as it is; where no
    demotion makes it fit, the plan with every head demoted, CLO's smallest, so that the allocation's refusal quotes
    the least CLO needs."""
    budget, heads = spec.gpu_budget_bytes, plan.heads
    if budget is None or split_host(estimate_parts(cfg, plan, spec)).device_bytes <= budget:
        return plan
    order = sorted((heads.difficulty[l][h], l, h) for l, hs in enumerate(heads.persistent) for h in hs)
    trial = plan
    for n in range(1, len(order) + 1):
        trial = replace(plan, heads=heads.without([(l, h) for _, l, h in order[:n]]))
        if split_host(estimate_parts(cfg, trial, spec)).device_bytes <= budget:
            return trial
    return trial


def estimate_parts(cfg: CLOConfig, plan: CLOPlan, spec: KVSpec) -> dict[str, int]:
    """The bytes of CLO.memory_parts() from the shapes alone, for the spec's prompt length: what allocation and
    prefill will hold (a test checks the two agree)."""
    row, t0, b, hkv = spec.row_bytes, spec.prompt_tokens, spec.batch, spec.num_kv_heads
    host_row = spec.host_row_bytes  # the host store's and the slots' rows (packed FP8 under kv_dtype=fp8)
    sink, recent, n_mid = split_prompt(t0, cfg.sink, cfg.recent)
    k, g = k_select(cfg, t0), spec.group_size
    dense = min(cfg.dense_layers, spec.num_layers)
    parts = {
        "slots": 0,
        "labels": 0,
        "persistent": 0,
        "window": 0,
        "metadata": 0,
        "dense_layers": b * dense * hkv * spec.max_len * row,
        "host": 0,
    }
    for layer in range(dense, spec.num_layers):
        nc = hkv - len(plan.heads.persistent[layer])
        parts["slots"] += b * nc * k * (host_row + 8)  # rows + their token indices
        parts["labels"] += b * nc * (g * spec.head_dim * 4 + 1)  # fp32 labels + valid flag
        parts["persistent"] += b * (hkv - nc) * t0 * row
        parts["window"] += b * hkv * (sink + recent + spec.max_len - t0) * row
        parts["metadata"] += (
            b * hkv * metadata_bytes_per_head(cfg.retriever, cfg.rbit, spec.head_dim, spec.dtype_bytes, n_mid)
        )
        parts["host"] += b * hkv * t0 * host_row
    return parts
