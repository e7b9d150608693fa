"""Rotary position embedding, with Llama-3 frequency scaling. cos/sin are computed for the positions asked
for instead of a max_position table, which at 1M positions would cost 512 MB."""

from __future__ import annotations

import math

import torch

from kvoffload.kernels.dense_ops import apply_rotary, cos_sin  # noqa: F401 (the decoder's RoPE, re-exported)
from kvoffload.model.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if cfg.rope_scaling is None:
        return inv
    s = cfg.rope_scaling
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def rope_frequencies(cfg: ModelConfig) -> tuple[float, ...]:
    """The model's rotary frequencies as KVSpec.rope_inv_freq hands them to a system (which never sees the model)."""
    return tuple(inverse_frequencies(cfg).tolist())


class Rotary:
    def __init__(self, cfg: ModelConfig, device: torch.device):
        self.inv_freq = inverse_frequencies(cfg).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return cos_sin(positions, self.inv_freq, dtype)
