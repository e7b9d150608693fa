"""What CLO's prefill does beside building a layer's store: each layer's K/V staged in the store's head order (the
host stores are allocated before it and the copies made behind it by kvoffload.offload.host)."""

from __future__ import annotations

import torch


def staged_kv(k: torch.Tensor, v: torch.Tensor, order: list[int]) -> torch.Tensor:
    """k, v [B, Hkv, T0, D] -> one [B, Hkv, T0, 2, D] copy with the KV heads in `order`, written head by head
    (stacking, then permuting, would make two)."""
    b, hkv, t0, d = k.shape
    kv = k.new_empty(b, hkv, t0, 2, d)
    for j, h in enumerate(order):
        kv[:, j, :, 0], kv[:, j, :, 1] = k[:, h], v[:, h]
    return kv
