"""A link clock on the GPU's timeline that paces transfers to a rate below the real link's (hardware.link_gb_s;
docs/gpu.md, "A slower link").

One int64 clock per direction lives in device memory, in nanoseconds of the GPU's %globaltimer. A transfer of n bytes
claims the slot [start, start + n / rate) with start = max(clock, now) and moves the clock to the slot's end (one
atomic compare-and-swap: streams that move bytes at once take consecutive slots, so their sum keeps to the rate). On
the transfer's stream:

  claim   a one-program kernel: counts the bytes (fixed, or from a device mask: the missed heads of a UVA gather,
          known only on the GPU), claims the slot, writes its end to `end`, and spins until its start
  move    the transfer itself, at the real link's speed
  wait    a one-program kernel that spins until the slot's end: whatever the stream runs next sees the data no
          earlier than a link of that rate would deliver it

A copy is split into chunks of about PACE_QUANTUM_S at the cap (`quantum_bytes`), each with its own claim, so that a
long copy and a concurrent transfer interleave as they would on a slower link; one wait follows the last chunk. The
clock is read and spun on in the GPU's own time, so pacing holds inside CUDA graphs and never waits on the CPU.

`claim_ref` is the clock's specification and `simulate_ref` a plain model of paced chunks on a link (the tests' and
the docs' reference); the kernels need a GPU (%globaltimer has no interpreter equivalent).
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: no GPU timeline to pace
    triton = None

# a chunk's slot at the cap: long against %globaltimer's tick (up to a microsecond) and a launch, short against a
# layer's compute, so a layer's transfers are paced in several slots
PACE_QUANTUM_S = 200e-6
ALIGN = 1 << 16  # chunk sizes are multiples of 64 KiB (the copy engine's efficient sizes)


def slot_ns(nbytes: int, bytes_per_s: float) -> int:
    """The slot n bytes take at the cap, in whole nanoseconds (rounded up: never faster than the cap)."""
    if bytes_per_s <= 0:
        raise ValueError(f"bytes_per_s={bytes_per_s} must be above 0")
    return math.ceil(nbytes * 1e9 / bytes_per_s)


def quantum_bytes(bytes_per_s: float, quantum_s: float = PACE_QUANTUM_S, align: int = ALIGN) -> int:
    """A paced copy's chunk: the bytes of one quantum at the cap, rounded up to `align` (at least one `align`)."""
    return max(align, math.ceil(bytes_per_s * quantum_s / align) * align)


def chunk_rows(rows: int, row_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """[a, b) row ranges of a copy of `rows` rows of `row_bytes` each, about chunk_bytes each (at least one row a
    chunk; the last may be shorter), covering every row once, in order."""
    per = max(1, chunk_bytes // max(row_bytes, 1))
    return [(a, min(a + per, rows)) for a in range(0, rows, per)]


def claim_ref(clock: int, now: int, dt: int) -> tuple[int, int]:
    """The claim kernel's arithmetic: (slot start, the clock after) for a slot of dt ns claimed at time `now`."""
    start = max(clock, now)
    return start, start + dt


def simulate_ref(
    transfers: list[tuple[int, list[int]]], cap_bytes_per_s: float, link_bytes_per_s: float
) -> list[tuple[int, int]]:
    """Paced transfers on a link of link_bytes_per_s, capped at cap_bytes_per_s: each transfer (issue time ns, its
    chunks' bytes) runs on a stream of its own as claim, move, ..., claim, move, wait. Returns each transfer's
    (first claim's start, end) in ns. The model: claims are served in the order they are issued (earlier issue
    first, then list order), a chunk moves at the real link's rate from its slot's start, and a stream's next claim
    is issued when its chunk has moved."""
    clock = 0
    events = [(t, i, 0) for i, (t, _) in enumerate(transfers)]  # (time the claim is issued, transfer, chunk)
    first: dict[int, int] = {}
    ends = [0] * len(transfers)
    while events:
        events.sort()
        now, i, c = events.pop(0)
        chunk = transfers[i][1][c]
        start, clock = claim_ref(clock, now, slot_ns(chunk, cap_bytes_per_s))
        first.setdefault(i, start)
        moved = start + slot_ns(chunk, link_bytes_per_s)
        if c + 1 < len(transfers[i][1]):
            events.append((moved, i, c + 1))
        else:
            ends[i] = max(start + slot_ns(chunk, cap_bytes_per_s), moved)  # the wait: the slot's end, or later
    return [(first[i], ends[i]) for i in range(len(transfers))]


if triton is not None:

    @triton.jit
    def _now():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)

    @triton.jit
    def _claim_kernel(
        Clock,
        End,
        Count,
        n,
        base_ns,
        unit_ns,
        COUNTED: tl.constexpr,
        NONNEG: tl.constexpr,
        OTHER: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        dt = base_ns
        if COUNTED:  # the moved units, counted on the GPU: a miss mask (!= 0) or block sources (>= 0)
            total = tl.sum(tl.zeros((BLOCK,), tl.int32), axis=0)
            for i in range(0, n, BLOCK):
                offs = i + tl.arange(0, BLOCK)
                x = tl.load(Count + offs, mask=offs < n, other=OTHER)
                if NONNEG:
                    hit = x >= 0
                else:
                    hit = x != 0
                total += tl.sum(hit.to(tl.int32), axis=0)
            dt = dt + total.to(tl.float32) * unit_ns
        span = tl.math.ceil(dt).to(tl.int64)
        now = _now()
        cur = tl.atomic_add(Clock, 0)  # an atomic read of the clock
        start = tl.maximum(cur, now)
        seen = tl.atomic_cas(Clock, cur, start + span)
        while seen != cur:  # another stream claimed meanwhile: claim after it
            cur = seen
            start = tl.maximum(cur, now)
            seen = tl.atomic_cas(Clock, cur, start + span)
        tl.store(End, start + span)
        t = now
        while t < start:
            t = _now()

    @triton.jit
    def _wait_kernel(End):
        end = tl.load(End)
        t = _now()
        while t < end:
            t = _now()


def claim(clock, end, ns_per_byte: float, nbytes: int = 0, count: torch.Tensor | None = None, unit_bytes: int = 0):
    """On the current stream: claim a slot for nbytes, plus unit_bytes per counted entry of `count` (a bool mask: its
    true entries; an int32 tensor: its entries >= 0), write its end to `end` and wait until its start. clock, end:
    one-element int64 device tensors. Float nanoseconds travel as kernel arguments: an int argument equal to 1 would
    be specialised to a constant."""
    base = float(nbytes * ns_per_byte)
    if count is None:
        _claim_kernel[(1,)](
            clock, end, clock, 0, base, 0.0, COUNTED=False, NONNEG=False, OTHER=0, BLOCK=1024, num_warps=1
        )
        return
    nonneg = count.dtype != torch.bool
    flat = count.reshape(-1)
    flat = (flat if flat.is_contiguous() else flat.contiguous()) if nonneg else flat.contiguous().view(torch.uint8)
    _claim_kernel[(1,)](
        clock,
        end,
        flat,
        flat.numel(),
        base,
        float(unit_bytes * ns_per_byte),
        COUNTED=True,
        NONNEG=nonneg,
        OTHER=-1 if nonneg else 0,
        BLOCK=1024,
        num_warps=1,
    )


def wait(end: torch.Tensor) -> None:
    """On the current stream: spin until the GPU's clock reaches `end` (the last claimed slot's end)."""
    _wait_kernel[(1,)](end, num_warps=1)
