"""What CLO's prefill does beside building a layer's store: the host stores allocated before it, each layer's K/V
staged in the store's head order, and offloaded (copied to host memory, its keys hash-encoded) while the next
layer computes."""

from __future__ import annotations

from collections.abc import Callable

import torch

from clo.store import host_buffer
from kvoffload.kv.interface import KVSpec


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


class Offload:
    """On CUDA, a layer's host copy (into pinned memory: the copy engine, beside the compute stream's kernels) and
    its encoding run on a stream of their own, behind the layer's compute, while the decoder goes on to the next
    layer. The staged K/V they read is held until an event after them has completed: freed earlier, its memory
    would go to the next layer's kernels on the compute stream while the copy still reads it. Off CUDA both run
    in place."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pending: tuple[torch.cuda.Event, torch.Tensor] | None = None  # (done, the staged K/V)

    def start(self, kv: torch.Tensor, host: torch.Tensor, encode: Callable[[], None]) -> None:
        """host <- kv, and encode(), after the work queued so far on the current stream."""
        if self.stream is None:
            host.copy_(kv)
            encode()
            return
        self.finish()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            host.copy_(kv, non_blocking=True)
            encode()
            done = torch.cuda.Event()
            done.record()
        self.pending = (done, kv)

    def finish(self) -> None:
        """Waits on the host for the last offload to complete, then lets go of its staged K/V. A layer's prefill
        calls it first: by then the decoder has queued that layer's compute, which keeps the GPU busy meanwhile."""
        if self.pending is not None:
            self.pending[0].synchronize()
            self.pending = None
