"""Which heads are hard to reuse, and what to do with them: Eq. 11-13 (docs/systems.md, "Persistent heads and
prefetch"). Pure Python over small tables: testable anywhere.

  D_i = tau_i - (s_hat_i - epsilon)                 reuse difficulty; D_i > 0: hard to reuse
  N_p = floor(T_comp * B_link / mem_head)            heads whose top-k KV the link moves in one layer
  N_persist^l = max(|hard heads in layer l| - N_p, 0)
The N_persist hardest heads of a layer keep their full KV on the GPU; the other hard heads (at most N_p)
are refreshed by speculative prefetch every step.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch

from kvoffload.errors import ConfigError
from kvoffload.paths import repo_path


@dataclass
class HeadPlan:
    persistent: list[list[int]]  # per layer: kv heads whose full KV lives on the GPU
    prefetch: list[list[int]]  # per layer: hard heads refreshed every step by speculative prefetch
    n_p: int
    difficulty: list[list[float]] = field(default_factory=list)
    # per layer: hard heads that Eq. 13 made persistent but the device budget did not hold (cached path instead)
    demoted: list[list[int]] = field(default_factory=list)

    def summary(self) -> dict:
        return {
            "n_p": self.n_p,
            "persistent_heads": sum(map(len, self.persistent)),
            "prefetch_heads": sum(map(len, self.prefetch)),
            "demoted_heads": sum(map(len, self.demoted)),
            "persistent": self.persistent,
            "prefetch": self.prefetch,
            "demoted": self.demoted,
        }

    def without(self, demote: list[tuple[int, int]]) -> HeadPlan:
        """This plan with the (layer, head) pairs in `demote` moved from persistent to the cached path."""
        persistent = [sorted(set(p) - {h for l, h in demote if l == layer}) for layer, p in enumerate(self.persistent)]
        demoted = [
            sorted({*(self.demoted[layer] if self.demoted else []), *{h for l, h in demote if l == layer}})
            for layer in range(len(self.persistent))
        ]
        return HeadPlan(persistent, self.prefetch, self.n_p, self.difficulty, demoted)


def heads_per_layer_time(layer_time_s: float, link_bytes_per_s: float, head_bytes: int) -> int:
    """Eq. 12."""
    if head_bytes <= 0:
        return 0
    return int(math.floor(layer_time_s * link_bytes_per_s / head_bytes))


def plan_persistent_heads(
    tau: torch.Tensor, s_hat: torch.Tensor, epsilon: float, n_p: int, skip_layers: int = 0
) -> HeadPlan:
    """tau, s_hat: [layers, kv_heads]. Layers below skip_layers (kept dense) get no plan."""
    if tau.shape != s_hat.shape:
        raise ConfigError(f"profile shape {tuple(s_hat.shape)} does not match the model's {tuple(tau.shape)}")
    diff = tau - (s_hat - epsilon)
    persistent, prefetch = [], []
    for layer in range(tau.shape[0]):
        if layer < skip_layers:
            persistent.append([])
            prefetch.append([])
            continue
        hard = [h for h in diff[layer].argsort(descending=True).tolist() if diff[layer, h] > 0]
        n_persist = max(len(hard) - n_p, 0)
        persistent.append(sorted(hard[:n_persist]))
        prefetch.append(sorted(hard[n_persist:]))
    return HeadPlan(persistent, prefetch, n_p, diff.tolist())


def load_profile(source: str, num_layers: int, num_kv_heads: int) -> tuple[torch.Tensor, str]:
    """s_hat [layers, kv_heads]. source: 'none' (s_hat = 1: no head is hard, persistent cache and prefetch
    idle) or a JSON file written by `python -m experiments.producers.profile` (relative paths: from the repository
    root)."""
    if source in (None, "none"):
        return torch.ones(num_layers, num_kv_heads), "none (s_hat = 1: no hard heads)"
    path = repo_path(source)
    if not path.is_file():
        raise ConfigError(f"profile={source!r}: no such file (make it with `python -m experiments.producers.profile`)")
    data = json.loads(path.read_text())
    s_hat = torch.tensor(data["s_hat"])
    if s_hat.shape != (num_layers, num_kv_heads):
        raise ConfigError(
            f"profile {path.name} has shape {tuple(s_hat.shape)}, the model needs ({num_layers}, {num_kv_heads})"
        )
    return s_hat, f"profile {path.name} ({data.get('source', 'unknown source')})"
