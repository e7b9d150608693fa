"""What every offloading system keeps on the device whatever it retrieves: the leading dense layers (their whole
KV, attended densely) and, per sparse layer, the window of always-attended rows (sink, recent, generated).

Both index the current token through device tensors set once per step (`begin_step`), so that a step that
uses them can be replayed from a CUDA graph."""

from __future__ import annotations

import torch

from kvoffload.kernels.decode_attention import decode_attention
from kvoffload.kv.interface import KVSpec


def prompt_window(k: torch.Tensor, v: torch.Tensor, sink: int, recent: int, max_len: int) -> torch.Tensor:
    """k, v [B, Hkv, T0, D] (views of a staged [B, Hkv, T0, 2, D] will do) -> window [B, Hkv, sink + recent +
    max_len - T0, 2, D]: the sink rows, the recent rows, then room for every generated token."""
    b, hkv, t0, d = k.shape
    window = torch.empty(b, hkv, sink + recent + max_len - t0, 2, d, dtype=k.dtype, device=k.device)
    for j, x in enumerate((k, v)):
        window[:, :, :sink, j] = x[:, :, :sink]
        window[:, :, sink : sink + recent, j] = x[:, :, t0 - recent : t0]
    return window


def window_positions(t0: int, sink: int, recent: int, device: torch.device) -> torch.Tensor:
    """The prompt positions prompt_window keeps: the first `sink` and the last `recent` of t0 (already split)."""
    return torch.cat([torch.arange(sink), torch.arange(t0 - recent, t0)]).to(device)


class DenseLayers:
    """The first `count` layers of a model under a sparse system: full KV on the device, dense attention through
    the decode-attention kernel (its torch reference off CUDA)."""

    def __init__(self, spec: KVSpec, count: int):
        self.spec, self.count = spec, min(count, spec.num_layers)
        self.kv: list[torch.Tensor | None] = [None] * self.count
        self.lengths = torch.zeros(spec.batch, dtype=torch.long, device=spec.device)  # attended rows, this step

    def __contains__(self, layer: int) -> bool:
        return layer < self.count

    def prefill(self, layer: int, kv: torch.Tensor) -> None:
        """kv [B, Hkv, T0, 2, D]: the prompt's rows, in a buffer with room for every generated token."""
        s = self.spec
        buf = torch.empty(s.batch, s.num_kv_heads, s.max_len, 2, s.head_dim, dtype=s.dtype, device=s.device)
        buf[:, :, : kv.shape[2]] = kv
        self.kv[layer] = buf

    def begin_step(self, length: int) -> None:
        self.lengths.fill_(length + 1)

    def decode(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: torch.Tensor
    ) -> torch.Tensor:
        """Appends k, v [B, Hkv, D] at the device index `position` [1] and attends q [B, H, D] over every row."""
        buf = self.kv[layer]
        buf.index_copy_(2, position, torch.stack([k, v], dim=2)[:, :, None])
        return decode_attention(q, buf[:, :, :, 0].transpose(1, 2), buf[:, :, :, 1].transpose(1, 2), self.lengths)

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.kv if b is not None)

    def step_bytes(self, length: int) -> int:
        """Device bytes one step's attention reads here, with `length` tokens held before it."""
        s = self.spec
        held = sum(1 for b in self.kv if b is not None)
        return held * s.batch * s.num_kv_heads * (length + 1) * 2 * s.head_dim * s.dtype_bytes
