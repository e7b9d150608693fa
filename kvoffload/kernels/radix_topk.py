"""Exact top-k of fp32 scores by radix select: the indices of the k largest scores of each row, in no order, or
ascending (ordered=True).

  scores [R, T] fp32 -> offset + idx [R, k] int64

torch.topk at k = 13K of 131K candidates takes longer than the hash scores it selects from, and a CLO layer
makes two (the cached heads on the side stream, the persistent heads on the compute stream);
results/bench/README.md times both selects. Radix select needs no sort. Each score becomes an order-preserving
32-bit key; four histogram passes over the key's bytes, high to low, each counting only the keys that match the
bytes fixed so far, find the k-th largest key exactly; one last pass writes every index whose key is above it and
as many equal to it as k still needs. Five kernels, a fixed grid and no host sync: CUDA-graph capturable.
Ordered, the last pass is two: each block of keys counts its selected keys, then writes them after those of the
blocks before it (a prefix of the counts instead of atomics): the indices come out ascending with no sort, for a
caller whose consumer wants them so (RetroInfer-style's LRU takes its blocks in ascending order; a sort after an
unordered select cost more than the select in its step).
Which of several equal scores at the boundary are taken is unspecified, as in torch.topk (so a CPU and a GPU
run may select different tied tokens). NaN scores are not supported (torch.topk ranks every NaN highest; here
a NaN with its sign bit set ranks lowest); retrieval scores are finite.

`topk_ref` (torch.topk) is the specification; `topk_indices` picks the kernel on CUDA and torch elsewhere.
"""

from __future__ import annotations

import torch

from kvoffload.kernels.radix_keys import BINS, PASSES, miss_rows, radix_work

try:
    import triton
    import triton.language as tl

    from kvoffload.kernels.radix_keys import needed, order_key
except ImportError:  # CPU machines: the reference is used
    triton = None


def topk_ref(scores: torch.Tensor, k: int, offset: int = 0) -> torch.Tensor:
    return scores.topk(k, dim=-1, sorted=False).indices + offset


if triton is not None:

    @triton.jit
    def _keys(Scores, row, t, mask, stride_r):
        return order_key(tl.load(Scores + row.to(tl.int64) * stride_r + t, mask=mask, other=0.0))

    @triton.jit
    def _descend(Hist, row, R, K, DONE: tl.constexpr):
        """From the first DONE passes' histograms: the key bytes fixed so far (prefix) and how many of the keys
        that share them still belong to the top k (need)."""
        bins = tl.arange(0, 256)
        prefix = tl.zeros([], tl.uint32)
        need = K
        for p in tl.static_range(DONE):
            h = tl.load(Hist + (p * R + row) * 256 + bins)
            above = tl.cumsum(h, 0, reverse=True) - h  # keys in higher bins
            b = tl.min(tl.where(above < need, bins, 256))  # the bin holding the need-th largest key
            need -= tl.sum(tl.where(bins == b, above, 0))
            prefix = (prefix << 8) | b.to(tl.uint32)
        return prefix, need

    @triton.jit
    def _histogram_kernel(
        Scores, Hist, T, K, R, stride_r, Miss, NC, H, P: tl.constexpr, BLOCK: tl.constexpr, HAS_MISS: tl.constexpr
    ):
        row = tl.program_id(0)
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = t < T
        if HAS_MISS:  # row = b * H + j
            mask = tl.where(needed(Miss, row // H, row % H, NC), mask, False)
        key = _keys(Scores, row, t, mask, stride_r)
        if P > 0:
            prefix, need = _descend(Hist, row, R, K, P)
            mask = mask & ((key >> (32 - 8 * P)) == prefix)
        digit = ((key >> (24 - 8 * P)) & 255).to(tl.int32)
        counts = tl.histogram(digit, 256, mask=mask)
        tl.atomic_add(Hist + (P * R + row) * 256 + tl.arange(0, 256), counts, mask=counts > 0, sem="relaxed")

    @triton.jit
    def _last_pass(Scores, Hist, row, t, T, K, R, stride_r, Miss, NC, H, HAS_MISS: tl.constexpr):
        """The last pass's view of keys t of a row: (above, equal) int32 flags of the keys above the k-th largest
        and equal to it, and how many of the equal ones the top k takes (need)."""
        mask = t < T
        if HAS_MISS:
            mask = tl.where(needed(Miss, row // H, row % H, NC), mask, False)
        key = _keys(Scores, row, t, mask, stride_r)
        kth, need = _descend(Hist, row, R, K, 4)  # kth: the k-th largest key itself
        return (mask & (key > kth)).to(tl.int32), (mask & (key == kth)).to(tl.int32), need

    @triton.jit
    def _compact_kernel(
        Scores,
        Hist,
        Count,
        Out,
        T,
        K,
        R,
        offset,
        stride_r,
        stride_o,
        Miss,
        NC,
        H,
        BLOCK: tl.constexpr,
        HAS_MISS: tl.constexpr,
    ):
        row = tl.program_id(0)
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        above, equal, need = _last_pass(Scores, Hist, row, t, T, K, R, stride_r, Miss, NC, H, HAS_MISS)
        # a block claims a run of output places per kind with one atomic, then fills it in order
        at_above = tl.atomic_add(Count + row * 2, tl.sum(above, 0), sem="relaxed") + tl.cumsum(above, 0) - 1
        at_equal = tl.atomic_add(Count + row * 2 + 1, tl.sum(equal, 0), sem="relaxed") + tl.cumsum(equal, 0) - 1
        out = Out + row.to(tl.int64) * stride_o
        pos = t.to(tl.int64) + offset
        tl.store(out + at_above, pos, mask=above != 0)
        tl.store(out + (K - need) + at_equal, pos, mask=(equal != 0) & (at_equal < need))

    @triton.jit
    def _block_counts_kernel(
        Scores, Hist, Counts, T, K, R, stride_r, Miss, NC, H, NB, BLOCK: tl.constexpr, HAS_MISS: tl.constexpr
    ):
        """Ordered, first: how many keys of each block are above the k-th largest, and how many equal to it."""
        row, blk = tl.program_id(0), tl.program_id(1)
        t = blk * BLOCK + tl.arange(0, BLOCK)
        above, equal, _ = _last_pass(Scores, Hist, row, t, T, K, R, stride_r, Miss, NC, H, HAS_MISS)
        at = Counts + (row * NB + blk) * 2
        tl.store(at, tl.sum(above, 0))
        tl.store(at + 1, tl.sum(equal, 0))

    @triton.jit
    def _compact_ordered_kernel(
        Scores,
        Hist,
        Counts,
        Out,
        T,
        K,
        R,
        offset,
        stride_r,
        stride_o,
        Miss,
        NC,
        H,
        NB,
        BLOCK: tl.constexpr,
        NB_P2: tl.constexpr,
        HAS_MISS: tl.constexpr,
    ):
        """Ordered, then: each block writes its selected keys after those of the blocks before it (their counts
        summed), so the indices come out in position order; the first `need` equal keys of the row are taken."""
        row, blk = tl.program_id(0), tl.program_id(1)
        t = blk * BLOCK + tl.arange(0, BLOCK)
        above, equal, need = _last_pass(Scores, Hist, row, t, T, K, R, stride_r, Miss, NC, H, HAS_MISS)
        j = tl.arange(0, NB_P2)
        before = Counts + (row * NB + j) * 2
        above_before = tl.sum(tl.load(before, mask=j < blk, other=0), 0)
        equal_before = tl.sum(tl.load(before + 1, mask=j < blk, other=0), 0)
        first = (equal_before + tl.cumsum(equal, 0) - equal) < need  # among the row's first `need` equal keys
        sel = ((above != 0) | ((equal != 0) & first)).to(tl.int32)
        at = above_before + tl.minimum(equal_before, need) + tl.cumsum(sel, 0) - 1
        tl.store(Out + row.to(tl.int64) * stride_o + at, t.to(tl.int64) + offset, mask=sel != 0)


def radix_topk(
    scores: torch.Tensor,
    k: int,
    offset: int = 0,
    block: int = 2048,
    num_warps: int = 4,
    miss: torch.Tensor | None = None,
    work: torch.Tensor | None = None,
    ordered: bool = False,
) -> torch.Tensor:
    """2048 keys per program, 4 warps: the fastest for 6 rows of 128K in experiments/bench/tune_retrieval_kernels.py's
    sweep (results/bench/README.md). miss [B, nc] bool (hash_scores's): the rows are B sequences of h heads
    each, and the first nc heads of a sequence are selected only where they missed (the others' indices are
    left unset). work: radix_work(R) with the first pass already counted; three passes then remain. ordered: each
    row's indices ascending (one kernel more)."""
    r, t = scores.shape
    assert scores.dtype == torch.float32 and 0 <= k <= t, (scores.dtype, k, t)
    scores = scores if scores.stride(1) == 1 else scores.contiguous()
    out = torch.empty(r, k, dtype=torch.long, device=scores.device)
    if not (r and k):
        return out
    counted = work is not None
    assert not counted or work.shape == (PASSES * r * BINS + 2 * r,), "work: radix_work(rows of scores)"
    work = work if counted else radix_work(r, scores.device)
    hist, count = work[: PASSES * r * BINS], work[PASSES * r * BINS :]
    grid = (r, triton.cdiv(t, block))
    heads = r // miss.shape[0] if miss is not None else r  # per sequence
    assert miss is None or heads * miss.shape[0] == r, (miss.shape, r)
    miss_u8, nc = miss_rows(miss, r // heads, scores)
    for p in range(int(counted), PASSES):
        _histogram_kernel[grid](
            scores,
            hist,
            t,
            k,
            r,
            scores.stride(0),
            miss_u8,
            nc,
            heads,
            P=p,
            BLOCK=block,
            HAS_MISS=miss is not None,
            num_warps=num_warps,
        )
    args = (t, k, r, offset, scores.stride(0), out.stride(0), miss_u8, nc, heads)
    if not ordered:  # every block of keys claims its output places by atomics
        _compact_kernel[grid](
            scores, hist, count, out, *args, BLOCK=block, HAS_MISS=miss is not None, num_warps=num_warps
        )
        return out
    # ordered: each block's counts, then each block writes after the blocks before it
    nb = grid[1]
    counts = torch.empty(r * nb * 2, dtype=torch.int32, device=scores.device)
    _block_counts_kernel[grid](
        scores,
        hist,
        counts,
        t,
        k,
        r,
        scores.stride(0),
        miss_u8,
        nc,
        heads,
        nb,
        BLOCK=block,
        HAS_MISS=miss is not None,
        num_warps=num_warps,
    )
    _compact_ordered_kernel[grid](
        scores,
        hist,
        counts,
        out,
        *args,
        nb,
        BLOCK=block,
        NB_P2=triton.next_power_of_2(nb),
        HAS_MISS=miss is not None,
        num_warps=num_warps,
    )
    return out


def radix_runs(device: torch.device) -> bool:
    """Whether topk_indices selects fp32, bf16 or fp16 scores on `device` with the radix kernels (else torch.topk)."""
    return device.type == "cuda" and triton is not None


def topk_indices(
    scores: torch.Tensor,
    k: int,
    offset: int = 0,
    miss: torch.Tensor | None = None,
    work: torch.Tensor | None = None,
    ordered: bool = False,
) -> torch.Tensor:
    """scores [..., T] -> offset + indices [..., k] of the k largest along the last dim, in no order (ascending
    with ordered=True). miss, work: as radix_topk's, for scores [B, h, T] (the reference selects every row and
    needs no work)."""
    if radix_runs(scores.device) and scores.dtype in (torch.float32, torch.bfloat16, torch.float16):
        rows = scores.reshape(-1, scores.shape[-1]).float()  # bf16 / fp16 scores widen exactly to the keys' fp32
        return radix_topk(rows, k, offset, miss=miss, work=work, ordered=ordered).view(*scores.shape[:-1], k)
    idx = topk_ref(scores, k, offset)
    return idx.sort(dim=-1).values if ordered else idx
