"""What CLO's prefill does beside building a layer's store: the host stores allocated before it, each layer's K/V
staged in the store's head order, and offloaded (copied to host memory, its keys hash-encoded) while the next
layer computes."""

from __future__ import annotations

import torch

from kvoffload.kv.interface import KVSpec
from kvoffload.offload.host import host_buffer


def host_stores(spec: KVSpec, dense_layers: int) -> list[torch.Tensor | None]:
    """Every sparse layer's host store for a prompt of spec.prompt_len tokens, allocated (pinned on CUDA) before
    the prefill, as FullAttn allocates its device cache: pinning GBs keeps the host busy long enough to leave the
    prefill's GPU waiting for its next launches, and a failure to pin is reported before the long work. None
    where the prompt's length is not known yet (the store then allocates its own at prefill)."""
    if spec.prompt_len is None:
        return [None] * spec.num_layers
    shape = (spec.batch, spec.num_kv_heads, spec.prompt_len, 2, spec.head_dim)
    pinned = spec.device.type == "cuda"
    return [None if i < dense_layers else host_buffer(shape, spec.dtype, pinned) for i in range(spec.num_layers)]


def staged_kv(k: torch.Tensor, v: torch.Tensor, order: list[int]) -> torch.Tensor:
    """k, v [B, Hkv, T0, D] -> one [B, Hkv, T0, 2, D] copy with the KV heads in `order`, written head by head
    (stacking, then permuting, would make two)."""
    b, hkv, t0, d = k.shape
    kv = k.new_empty(b, hkv, t0, 2, d)
    for j, h in enumerate(order):
        kv[:, j, :, 0], kv[:, j, :, 1] = k[:, h], v[:, h]
    return kv
