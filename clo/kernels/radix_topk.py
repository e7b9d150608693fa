"""Exact top-k of fp32 scores by radix select: the indices of the k largest scores of each row, in no order.

  scores [R, T] fp32 -> offset + idx [R, k] int64

torch.topk at k = 13K of 131K candidates takes ~63 us per call on the H200 (bench_clo_layer), and a CLO layer
makes two (the cached heads on the side stream, the persistent heads on the compute stream): more than the
hash scores it selects from (35 us). Radix select needs no sort. Each score becomes an order-preserving 32-bit
key; three histogram passes over the key's digits (11, 11, 10 bits), high to low, each counting only the keys
that match the digits fixed so far, find the k-th largest key exactly; one last pass writes every index whose key
is above it and as many equal to it as k still needs. Four kernels and a memset, a fixed grid and no host sync:
CUDA-graph capturable.
Which of several equal scores at the boundary are taken is unspecified, as in torch.topk (so a CPU and a GPU
run may select different tied tokens). NaN scores are not supported (torch.topk ranks every NaN highest; here
a NaN with its sign bit set ranks lowest); retrieval scores are finite.

`topk_ref` (torch.topk) is the specification; `topk_indices` picks the kernel on CUDA and torch elsewhere.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: the reference is used
    triton = None

# one pass per digit of the key, high to low: three passes of 11, 11 and 10 bits (each pass is a launch, and a
# 2048-bin histogram costs a block little more than a 256-bin one; four 8-bit passes took ~6 us more per select)
SHIFTS, WIDTHS = (21, 10, 0), (11, 11, 10)
PASSES, BINS = len(SHIFTS), 2048


def topk_ref(scores: torch.Tensor, k: int, offset: int = 0) -> torch.Tensor:
    return scores.topk(k, dim=-1, sorted=False).indices + offset


if triton is not None:

    @triton.jit
    def _keys(Scores, row, t, mask, stride_r):
        """fp32 -> uint32 whose unsigned order is the float order (negatives flipped, positives above them)."""
        x = tl.load(Scores + row.to(tl.int64) * stride_r + t, mask=mask, other=0.0)
        u = x.to(tl.uint32, bitcast=True)
        return tl.where((u >> 31) != 0, ~u, u | 0x80000000)

    @triton.jit
    def _bin_of(Hist, p, row, R, need):
        """In pass p's histogram: the bin holding the need-th largest of the keys it counted, and how many of that
        bin's keys still belong to the top k."""
        bins = tl.arange(0, 2048)
        h = tl.load(Hist + (p * R + row) * 2048 + bins)
        above = tl.cumsum(h, 0, reverse=True) - h  # keys in higher bins
        b = tl.min(tl.where(above < need, bins, 2048))
        return b.to(tl.uint32), need - tl.sum(tl.where(bins == b, above, 0))

    @triton.jit
    def _descend(Hist, row, R, K, DONE: tl.constexpr):
        """From the first DONE passes' histograms: the key bits fixed so far (prefix) and how many of the keys
        that share them still belong to the top k (need). The widths are WIDTHS'."""
        prefix = tl.zeros([], tl.uint32)
        need = K
        if DONE > 0:
            prefix, need = _bin_of(Hist, 0, row, R, need)
        if DONE > 1:
            b, need = _bin_of(Hist, 1, row, R, need)
            prefix = (prefix << 11) | b
        if DONE > 2:
            b, need = _bin_of(Hist, 2, row, R, need)
            prefix = (prefix << 10) | b
        return prefix, need

    @triton.jit
    def _histogram_kernel(Scores, Hist, T, K, R, stride_r, P: tl.constexpr, SHIFT: tl.constexpr,
                          WIDTH: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = t < T
        key = _keys(Scores, row, t, mask, stride_r)
        if P > 0:
            prefix, need = _descend(Hist, row, R, K, P)
            mask = mask & ((key >> (SHIFT + WIDTH)) == prefix)
        digit = ((key >> SHIFT) & ((1 << WIDTH) - 1)).to(tl.int32)
        counts = tl.histogram(digit, 2048, mask=mask)
        tl.atomic_add(Hist + (P * R + row) * 2048 + tl.arange(0, 2048), counts, mask=counts > 0, sem="relaxed")

    @triton.jit
    def _compact_kernel(Scores, Hist, Count, Out, T, K, R, offset, stride_r, stride_o, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = t < T
        key = _keys(Scores, row, t, mask, stride_r)
        kth, need = _descend(Hist, row, R, K, 3)  # kth: the k-th largest key itself
        above = (mask & (key > kth)).to(tl.int32)
        equal = (mask & (key == kth)).to(tl.int32)
        # a block claims a run of output places per kind with one atomic, then fills it in order
        at_above = tl.atomic_add(Count + row * 2, tl.sum(above, 0), sem="relaxed") + tl.cumsum(above, 0) - 1
        at_equal = tl.atomic_add(Count + row * 2 + 1, tl.sum(equal, 0), sem="relaxed") + tl.cumsum(equal, 0) - 1
        out = Out + row.to(tl.int64) * stride_o
        pos = t.to(tl.int64) + offset
        tl.store(out + at_above, pos, mask=above != 0)
        tl.store(out + (K - need) + at_equal, pos, mask=(equal != 0) & (at_equal < need))


def radix_topk(scores: torch.Tensor, k: int, offset: int = 0, block: int = 4096, num_warps: int = 8) -> torch.Tensor:
    r, t = scores.shape
    assert scores.dtype == torch.float32 and 0 <= k <= t, (scores.dtype, k, t)
    scores = scores if scores.stride(1) == 1 else scores.contiguous()
    out = torch.empty(r, k, dtype=torch.long, device=scores.device)
    if not (r and k):
        return out
    work = torch.zeros(PASSES * r * BINS + 2 * r, dtype=torch.int32, device=scores.device)
    hist, count = work[: PASSES * r * BINS], work[PASSES * r * BINS:]
    grid = (r, triton.cdiv(t, block))
    for p, (shift, width) in enumerate(zip(SHIFTS, WIDTHS)):
        _histogram_kernel[grid](scores, hist, t, k, r, scores.stride(0), P=p, SHIFT=shift, WIDTH=width, BLOCK=block,
                                num_warps=num_warps)
    _compact_kernel[grid](scores, hist, count, out, t, k, r, offset, scores.stride(0), out.stride(0), BLOCK=block,
                          num_warps=num_warps)
    return out


def topk_indices(scores: torch.Tensor, k: int, offset: int = 0) -> torch.Tensor:
    """scores [..., T] -> offset + indices [..., k] of the k largest along the last dim, in no order."""
    if scores.is_cuda and triton is not None and scores.dtype == torch.float32:
        return radix_topk(scores.reshape(-1, scores.shape[-1]), k, offset).view(*scores.shape[:-1], k)
    return topk_ref(scores, k, offset)
