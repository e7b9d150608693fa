"""How well the speculative query selects a head's top-k (the accuracy side of CLO's persist_query switch).

CLO's persistent heads select their top-k rows with the layer's real query (persist_query=real) or, to take that
selection off the critical path, with the speculative query one layer ahead (docs/systems.md, "Speculative query")
(persist_query=speculative), as the prefetch heads always do. With real weights, each decode step and each KV head of
the sparse layers, this compares against the exact top-k of the real query (q . k over the prompt's middle, CLO's
sink/recent/top-k split):

  recall  |S & S*| / k             S* = exact top-k of the real query
  mass    the real query's softmax attention over the middle that S covers (group mean), S* the best possible

for S = hash (HATA) top-k of the real query, hash top-k of the speculative query, exact top-k of the speculative
query. Reported per layer and KV head, and as means over the hard heads (Eq. 11: the persistent and prefetch
candidates) and the others.

    python -m experiments.producers.speculative_selection system=clo seqlen=3k workload.gen_tokens=32 \\
        workload.stop_at_eos=false [+selection_out=results/speculative_selection_smollm2/record.json]
"""

from __future__ import annotations

import math
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from baselines.fullattn import FullAttn
from clo.policy.persistent import load_profile
from clo.policy.thresholds import load_importance, thresholds
from experiments.producers.profile import decode_real
from experiments.runner import run_settings
from experiments.runner.records import environment, write_measurement
from kvoffload.errors import ConfigError
from kvoffload.model.config import ModelConfig
from kvoffload.offload.budget import select_budget, split_prompt
from kvoffload.offload.retrieval import ExactRetriever, make_retriever, select_topk
from kvoffload.paths import ROOT

SELECTIONS = ("hash_real", "hash_speculative", "exact_speculative", "exact_real")


class SelectionProbe(FullAttn):
    """FullAttn (so the tokens are FullAttn's) that asks for the speculative query and, at every decode step of
    every layer from `first_layer` on, scores the selections of SELECTIONS against the real query's exact top-k."""

    wants_speculative_query = True

    def __init__(self, model_cfg: ModelConfig, prompt_len: int, sys_cfg: dict, first_layer: int):
        super().__init__()
        self.sink, self.recent, self.n_mid = split_prompt(prompt_len, sys_cfg["sink"], sys_cfg["recent"])
        self.k_sel = select_budget(prompt_len, sys_cfg["topk_ratio"], sys_cfg["sink"], sys_cfg["recent"])
        if not 0 < self.k_sel < self.n_mid:
            raise ConfigError(
                f"top-k {self.k_sel} of a middle of {self.n_mid} tokens: nothing to select; a longer seqlen"
            )
        self.first_layer, self.group = first_layer, model_cfg.group_size
        args = (model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim, torch.device("cpu"))
        # CLO's hash retriever: its learned weights where the config names them, else SimHash
        self.hash = make_retriever("hash", *args, sys_cfg["rbit"], sys_cfg["seed"], sys_cfg.get("hash_weights"))
        self.exact = ExactRetriever(*args)
        shape = (model_cfg.num_layers, model_cfg.num_kv_heads)
        self.sums = {
            f"{m}_{s}": torch.zeros(shape, dtype=torch.float64) for m in ("recall", "mass") for s in SELECTIONS
        }
        self.samples = torch.zeros(shape, dtype=torch.long)
        self.q_spec: dict[int, torch.Tensor] = {}

    def prefill(self, layer, k, v):
        super().prefill(layer, k, v)
        mid = k[:, :, self.sink : self.sink + self.n_mid].float().cpu()
        self.hash.index(layer, mid)
        self.exact.index(layer, mid)

    def prepare(self, layer, q_spec):
        self.q_spec[layer] = q_spec.float().cpu()

    def decode(self, layer, q, k, v):
        q_spec = self.q_spec.pop(layer, None)
        if q_spec is not None and layer >= self.first_layer:
            self._score(layer, q.float().cpu(), q_spec)
        return super().decode(layer, q, k, v)

    def _score(self, layer: int, q: torch.Tensor, q_spec: torch.Tensor) -> None:
        heads = torch.arange(self.exact.keys[layer].shape[1])

        def top(retriever, query):
            return select_topk(retriever.scores(layer, query, heads), self.k_sel, 0, method="torch")  # [B, Hkv, k]

        best = top(self.exact, q)
        chosen = {
            "hash_real": top(self.hash, q),
            "hash_speculative": top(self.hash, q_spec),
            "exact_speculative": top(self.exact, q_spec),
            "exact_real": best,
        }
        b, hkv, _, d = self.exact.keys[layer].shape
        logits = torch.einsum("bkgd,bktd->bkgt", q.view(b, hkv, self.group, d), self.exact.keys[layer])
        attn = torch.softmax(logits / math.sqrt(d), -1).mean(2)  # [B, Hkv, T_mid], the group's mean
        best_mask = torch.zeros_like(attn, dtype=torch.bool).scatter_(-1, best, True)
        for name, sel in chosen.items():
            hit = best_mask.gather(-1, sel)
            self.sums[f"recall_{name}"][layer] += hit.double().mean(-1).sum(0)
            self.sums[f"mass_{name}"][layer] += attn.gather(-1, sel).double().sum(-1).sum(0)
        self.samples[layer] += b


def hard_heads(sys_cfg: dict, model_cfg: ModelConfig) -> torch.Tensor:
    """[L, Hkv] bool: Eq. 11's hard-to-reuse heads under CLO's thresholds (persistent or prefetch candidates)."""
    L, hkv = model_cfg.num_layers, model_cfg.num_kv_heads
    importance, _ = load_importance(sys_cfg["importance"], L, hkv)
    tau = (
        thresholds(importance, sys_cfg["eta"], sys_cfg["n"])
        if sys_cfg["adaptive_threshold"]
        else torch.full((L, hkv), sys_cfg["eta"])
    )
    s_hat, _ = load_profile(sys_cfg["profile"], L, hkv)
    return tau - (s_hat - sys_cfg["epsilon"]) > 0


def measure(cfg: DictConfig) -> dict:
    sys_cfg = OmegaConf.to_container(cfg.system, resolve=True)
    if not str(sys_cfg.get("_target_", "")).endswith(".CLO"):
        raise ConfigError(
            "run with system=clo: its sink, recent, top-k, rbit, thresholds and profile set the selection"
        )
    first = max(int(sys_cfg["dense_layers"]), 1)  # layer 0 has no speculative query
    model_cfg, probe, desc = decode_real(
        cfg, lambda model_cfg, prompt_len: SelectionProbe(model_cfg, prompt_len, sys_cfg, first)
    )
    n = probe.samples.clamp_min(1)
    per_head = {key: (val / n).float() for key, val in probe.sums.items()}
    hard = hard_heads(sys_cfg, model_cfg)
    sparse = torch.zeros_like(hard)
    sparse[first:] = True

    def mean(x, mask):
        return round(float(x[mask].mean()), 4) if mask.any() else None

    summary = {
        group: {key: mean(val, mask) for key, val in per_head.items()}
        for group, mask in (("hard_heads", hard & sparse), ("other_heads", ~hard & sparse), ("all_heads", sparse))
    }
    return {
        "experiment": "speculative_selection",
        "model": model_cfg.name,
        "source": desc,
        "retriever": probe.hash.weights_source,
        "rbit": sys_cfg["rbit"],
        "k": probe.k_sel,
        "middle_tokens": probe.n_mid,
        "layers": f"{first}..{model_cfg.num_layers - 1}",
        "steps_per_head": int(probe.samples[first:].max()),
        "hard_heads": int((hard & sparse).sum()),
        "summary": summary,
        "per_head": {key: val.tolist() for key, val in per_head.items()},
        "hard": hard.tolist(),
        "environment": environment(run_settings.resolve_device(cfg.device)),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }


@hydra.main(config_path="../../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    data, out = write_measurement(
        measure,
        cfg,
        lambda d: Path(
            cfg.get("selection_out") or ROOT / "results" / f"speculative_selection_{d['model']}" / "record.json"
        ),
    )
    for group, vals in data["summary"].items():
        print(f"{group:>12} " + " ".join(f"{k}={v}" for k, v in vals.items()))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
