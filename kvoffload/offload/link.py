"""A host <-> device link slower than the real one, for every transfer path (hardware.link_gb_s; docs/gpu.md, "A
slower link"): `LinkPacer` paces copies and kernels that move KV bytes with the link clock of
kvoffload/kernels/link_pacer.py. A system makes one with `link_pacer(spec)`, None when the spec sets no cap: then
every path runs exactly as before, with no pacing work on the hot path.

  copy_(dst, src)     a copy-engine copy, in chunks of one pacing quantum, each after its slot's claim, then one wait
  moving(...)         around a kernel that moves bytes itself (the UVA gather, RetroInfer-style's block copy): one
                      slot, its bytes fixed or counted on the GPU from the kernel's own miss mask or block sources

Both directions have a clock of their own (PCIe moves both at once, each at the link's rate); the prefill's offload
to host memory is paced on the device -> host clock.
"""

from __future__ import annotations

import contextlib

import torch

from kvoffload.errors import ConfigError
from kvoffload.kernels import link_pacer as pacing  # not `link_pacer`: the factory below has that name
from kvoffload.kv.interface import KVSpec

H2D, D2H = 0, 1
MECHANISM = (
    "link clock on the GPU timeline (%globaltimer): each transfer claims a slot of bytes / cap on a device-side "
    "clock per direction, waits for its start and holds its stream until its end; copies are split into chunks of "
    f"{pacing.PACE_QUANTUM_S * 1e6:g} us at the cap"
)


class LinkPacer:
    """Paces transfers on `device` to `gb_s` (1e9 B/s) in each direction. Pacers of one device and rate share their
    clocks (`link_pacer`), so every system, stream and path of a process moves its bytes through the same slots."""

    def __init__(self, device: torch.device, gb_s: float) -> None:
        if device.type != "cuda":
            raise ConfigError(f"hardware.link_gb_s={gb_s:g} caps a GPU's host link: a {device.type} run has none")
        if pacing.triton is None:
            raise ConfigError("hardware.link_gb_s needs Triton on CUDA (the pacing kernels)")
        if not gb_s > 0:
            raise ConfigError(f"hardware.link_gb_s={gb_s!r} must be above 0")
        self.device, self.gb_s = device, gb_s
        self.ns_per_byte = 1.0 / gb_s  # 1e9 B/s: one byte takes 1 / gb_s ns
        self.chunk_bytes = pacing.quantum_bytes(gb_s * 1e9)
        self.clock = torch.zeros(2, dtype=torch.int64, device=device)  # [H2D, D2H], ns of %globaltimer

    def _end(self) -> torch.Tensor:
        # one slot end per paced transfer, on the stream it runs on: streams never share one
        return torch.empty(1, dtype=torch.int64, device=self.device)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """dst.copy_(src, non_blocking=True) at the cap, on the current stream: chunks of the flat tensors where both
        are contiguous (a layer's store at batch 1 is one row of dim 0), else along dim 0."""
        assert dst.shape == src.shape and dst.dtype == src.dtype, "a paced copy moves bytes as they are"
        direction = H2D if dst.is_cuda else D2H
        clock, end = self.clock[direction : direction + 1], self._end()
        d, s = (dst.view(-1), src.view(-1)) if dst.is_contiguous() and src.is_contiguous() else (dst, src)
        if d.dim() == 0 or not d.numel():
            pacing.claim(clock, end, self.ns_per_byte, d.numel() * d.element_size())
            d.copy_(s, non_blocking=True)
        else:
            row_bytes = d[0].numel() * d.element_size()
            for a, b in pacing.chunk_rows(d.shape[0], row_bytes, self.chunk_bytes):
                pacing.claim(clock, end, self.ns_per_byte, (b - a) * row_bytes)
                d[a:b].copy_(s[a:b], non_blocking=True)
        pacing.wait(end)
        return dst

    @contextlib.contextmanager
    def moving(self, nbytes: int = 0, count: torch.Tensor | None = None, unit_bytes: int = 0, to_device: bool = True):
        """Around a kernel that moves nbytes, plus unit_bytes per counted entry of `count` (a bool mask's true
        entries, an int32 tensor's entries >= 0), on the current stream: the slot is claimed before it and waited out
        after it. The count is read on the GPU (no host sync; capturable in a CUDA graph)."""
        direction = H2D if to_device else D2H
        clock, end = self.clock[direction : direction + 1], self._end()
        pacing.claim(clock, end, self.ns_per_byte, nbytes, count, unit_bytes)
        yield
        pacing.wait(end)


_PACERS: dict[tuple[torch.device, float], LinkPacer] = {}


def shared_pacer(device: torch.device, gb_s: float) -> LinkPacer:
    """The one pacer of this process for `device` at `gb_s`: every caller moves its bytes through its clocks."""
    key = (device, float(gb_s))
    if key not in _PACERS:
        _PACERS[key] = LinkPacer(device, gb_s)
    return _PACERS[key]


def link_pacer(spec: KVSpec) -> LinkPacer | None:
    """The pacer of the spec's link cap (shared_pacer), or None: no cap, nothing paced."""
    return None if spec.link_cap_gb_s is None else shared_pacer(spec.device, spec.link_cap_gb_s)


def paced_copy(pacer: LinkPacer | None, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst.copy_(src, non_blocking=True), through the pacer when there is one."""
    if pacer is None:
        return dst.copy_(src, non_blocking=True)
    return pacer.copy_(dst, src)


def moving(pacer: LinkPacer | None, **kw):
    """pacer.moving(**kw), or nothing to do without a pacer."""
    return contextlib.nullcontext() if pacer is None else pacer.moving(**kw)
