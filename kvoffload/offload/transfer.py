"""Moving selected KV rows from host memory into device cache slots (docs/systems.md, "Transfer").

The host store is head-major, one row = K and V of one token of one KV head ([B, Hkv, T, 2, D]): a row is
2*D*dtype bytes (512 B for d=128 bf16), read whole. Both paths write only the slots of missed heads:

  uva         a GPU kernel reads the rows from pinned, mapped host memory and writes them straight into the
              slots: no staging buffer, no CPU thread, no host sync (CUDA only)
  cpu_gather  the CPU gathers the rows (one native index_select on N threads, as hardware.md measured it)
              into a pinned staging buffer, then one async copy and a scatter into the slots; the indices
              must first come to the host (a sync) - the baselines' path

On a CPU device both are the same host-to-host gather of the missed heads' rows (uva_gather.gather_into_cpu: the
reference's result). With a `pacer` (hardware.link_gb_s) both paths move their rows at its cap
(kvoffload/offload/link.py): the UVA gather inside one slot of its missed heads' bytes, counted on the GPU, the
staging's copy in paced chunks."""

from __future__ import annotations

import math
import os

import torch

from kvoffload.errors import ConfigError
from kvoffload.kernels import uva_gather as uva_kernel
from kvoffload.kernels.uva_gather import gather_into_cpu, gather_rows_ref, record_moves_ref, uva_gather
from kvoffload.offload.link import LinkPacer, moving, paced_copy

TRANSFERS = ("uva", "cpu_gather")


def cpu_threads(threads: int | str) -> int:
    """A thread count, or 'auto': every core this process may run on (a baseline's CPU side at full strength)."""
    if threads == "auto":
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if isinstance(threads, str) or threads < 1:
        raise ConfigError(f"cpu_threads={threads!r} must be a count of at least 1, or auto")
    return int(threads)


class TransferEngine:
    def __init__(
        self,
        kind: str,
        threads: int | str,
        device: torch.device,
        uva_programs: int | None = None,
        pacer: LinkPacer | None = None,
    ):
        if kind not in TRANSFERS:
            raise ConfigError(f"transfer={kind!r}; valid: {', '.join(TRANSFERS)}")
        threads = cpu_threads(threads)
        if kind == "uva" and device.type == "cuda" and uva_kernel.triton is None:
            raise ConfigError("transfer=uva needs Triton on CUDA; use transfer=cpu_gather")
        self.kind, self.threads, self.device = kind, threads, device
        if uva_programs is not None and uva_programs < 1:
            raise ConfigError(
                f"uva_programs={uva_programs} must be at least 1, or null (one per tile of each (sequence, head))"
            )
        self.uva_programs = uva_programs  # cap on the gather's grid (None: one per tile of each (sequence, head))
        self.uva_warps = 4  # per gather program (bench_clo_layer compares others)
        self.host_syncs = 0
        self.pacer = pacer  # None: the real link, unpaced

    def fill(
        self,
        host: torch.Tensor,
        heads: torch.Tensor,
        idx: torch.Tensor,
        miss: torch.Tensor,
        slots: torch.Tensor,
        record: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """slots[b, h] := host rows idx[b, h] wherever miss[b, h]. slots [B, h, k, 2, D] on the device. record:
        (slot_idx, misses), uva_gather's bookkeeping of what moved (the uva kernel does it itself)."""
        if self.device.type == "cuda" and self.kind == "uva":
            # the slot's bytes: k rows of every missed head, counted on the GPU from the kernel's own mask
            with moving(self.pacer, count=miss, unit_bytes=math.prod(slots.shape[2:]) * slots.element_size()):
                uva_gather(
                    host, heads, idx, miss, slots, programs=self.uva_programs, num_warps=self.uva_warps, record=record
                )
            return
        if self.device.type == "cuda":
            self._cpu_gather(host, heads, idx, miss, slots)
        elif host.is_contiguous():
            gather_into_cpu(host, heads, idx, miss, slots)
        else:
            slots.copy_(torch.where(miss[..., None, None, None], gather_rows_ref(host, heads, idx), slots))
        record_moves_ref(idx, miss, record)

    def _cpu_gather(self, host, heads, idx, miss, slots) -> None:
        idx_h, miss_h = idx.cpu(), miss.cpu()  # waits for retrieval: the CPU-centric sync
        self.host_syncs += 1
        pairs = miss_h.nonzero()
        if not len(pairs):
            return
        b, h = pairs[:, 0], pairs[:, 1]
        t = host.shape[2]
        flat_idx = ((b * host.shape[1] + heads.cpu()[h]) * t)[:, None] + idx_h[b, h]
        rows = gather_to_device(host, flat_idx.view(-1), self.threads, self.device, self.pacer)
        slots[b.to(self.device), h.to(self.device)] = rows.view(len(pairs), *slots.shape[2:])


def to_device(values, dev: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A few host values (a list or a CPU tensor) onto the device with no host sync: torch.tensor(..., device=cuda)
    and .to(cuda) from pageable memory wait for the stream, which would stall a prefill that runs ahead."""
    t = torch.as_tensor(values, dtype=dtype)
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t


def gather_to_device(
    host: torch.Tensor, rows: torch.Tensor, threads: int, device: torch.device, pacer: LinkPacer | None = None
) -> torch.Tensor:
    """host [..., 2, D] (pinned on CUDA), rows [n] flat row indices on the host -> those rows [n, 2, D] on
    `device`: one native gather (torch's parallel index_select on `threads` OpenMP threads) into pinned staging,
    then one asynchronous copy (paced by `pacer` when given)."""
    flat = host.view(-1, host.shape[-2] * host.shape[-1])
    staging = torch.empty((rows.numel(), flat.shape[1]), dtype=host.dtype, pin_memory=device.type == "cuda")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.index_select(flat, 0, rows, out=staging)
    finally:
        torch.set_num_threads(before)
    if pacer is None or device.type != "cuda":
        return staging.to(device, non_blocking=True).view(-1, *host.shape[-2:])
    out = torch.empty(staging.shape, dtype=staging.dtype, device=device)
    return paced_copy(pacer, out, staging).view(-1, *host.shape[-2:])
