"""A synthetic query process for speed runs with synthetic weights, whose queries have no realistic dynamics.

Per layer and query head, the unit query direction follows u_t = normalise(rho * u_{t-1} + sqrt(1 - rho^2) * e)
with e a fresh random unit vector: in head_dim 64-128 the adjacent-step cosine similarity is then close to
rho, the head's s_hat from a profile measured on a real model (data/profiles/*.json). The model's own query
keeps its norm. One value per layer and step: the speculative query of the one-layer-ahead hook and the
layer's query are the same (perfect speculation), which every record states.

    python -m experiments.query_process data/profiles/smollm2.json --layers 32 --kv-heads 8 \\
        --out data/profiles/llama3-from-smollm2.json     # a profile at another model's shape
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvoffload.errors import ConfigError
from kvoffload.paths import repo_path, write_json_atomic
from clo.policy.persistent import load_profile


class ProfileQueryProcess:
    def __init__(self, s_hat: torch.Tensor, group: int, device: torch.device, source: str):
        self.rho = s_hat.clamp(-1.0, 1.0).repeat_interleave(group, dim=1).to(device)  # [L, H]
        self.state: list[torch.Tensor | None] = [None] * s_hat.shape[0]
        self.description = f"synthetic AR(1) query directions, rho per head = s_hat of {source}"

    @classmethod
    def from_profile(cls, path: str, num_layers: int, num_kv_heads: int, group: int, device: torch.device):
        s_hat, source = load_profile(path, num_layers, num_kv_heads)
        return cls(s_hat, group, device, source)

    def query(self, layer: int, q: torch.Tensor, advance: bool) -> torch.Tensor:
        """q [B, H, D] from the model -> the process's query for this layer and step, with q's norms."""
        norm = q.norm(dim=-1, keepdim=True)
        state = self.state[layer]
        if state is None:
            state = self.state[layer] = q / norm.clamp_min(1e-6)
        elif advance:
            rho = self.rho[layer][None, :, None].to(q.dtype)
            noise = torch.randn_like(q)
            noise = noise / noise.norm(dim=-1, keepdim=True)
            new = rho * state + (1 - rho * rho).clamp_min(0).sqrt() * noise
            # in place: a CUDA graph replays reads and writes of this very buffer, so the chain advances on
            # every replay (rebinding a new tensor would replay the captured step's input forever)
            state.copy_(new / new.norm(dim=-1, keepdim=True))
        return state * norm


def map_profile(s_hat: torch.Tensor, layers: int, kv_heads: int, seed: int = 0) -> torch.Tensor:
    """Another model's shape from a measured profile: values at evenly spaced quantiles of the measured
    distribution, placed on the heads in a seeded random order."""
    values = s_hat.flatten().sort().values
    n = layers * kv_heads
    picks = values[torch.linspace(0, len(values) - 1, n).round().long()]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return picks[perm].view(layers, kv_heads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--kv-heads", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    src = json.loads(repo_path(args.profile).read_text())
    if "s_hat" not in src:
        raise ConfigError(f"{args.profile} has no s_hat")
    mapped = map_profile(torch.tensor(src["s_hat"]), args.layers, args.kv_heads, args.seed)
    out = {"s_hat": mapped.tolist(), "source": f"quantile map of {Path(args.profile).name} (seed {args.seed}); "
                                              f"measured on: {src.get('source', 'unknown')}"}
    write_json_atomic(args.out, out)
    print(f"{args.out}: mean {mapped.mean():.3f}, {(mapped > 0.8).float().mean() * 100:.0f}% above 0.8")


if __name__ == "__main__":
    main()
