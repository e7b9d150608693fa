"""HATA's hash scores and their exact top-k in one launch (spec 2.4): what `hash_scores` followed by `radix_topk`
computes, without their seven launches.

  codes, norms, qcodes, heads   as clo/kernels/hash_score.py takes them
  -> offset + idx [B, h, k] int64: the k best-scoring candidates of each scored head, in no order

Why: a persistent head's top-k for the real query is on a CLO layer's critical path, and as separate kernels
(scores, a zero fill, four histogram passes, the compaction) it is a chain of small launches that leaves most of
the GPU idle (~40 us per layer at 128K on the H200, results/bench/clo_layer.json). Here each row (sequence,
head) is served by P programs that stay resident together: each scores its span of tokens once and keeps the
order-preserving keys in a scratch row (L2-resident), then the four radix passes of radix_topk.py run with a
grid barrier per pass among the row's programs (an arrival counter they poll) instead of a kernel boundary,
and the compaction follows in the same launch.

The barrier needs every program of a row resident at once: the grid is capped at the device's SM count, so
it always fits (programs of other kernels finish and make room). With one program per row (P = 1) no program
ever waits, which is how the Triton interpreter (one program at a time) runs it. The specification is
`hash_topk_ref`: radix_topk's, applied to hash_scores_ref's scores (ties at the boundary: either may be taken).
"""
from __future__ import annotations

import os

import torch

from clo.kernels.hash_score import _words, hash_scores_ref
from clo.kernels.radix_topk import PASSES, BINS, topk_ref

try:
    import triton
    import triton.language as tl

    from clo.kernels.hash_score import _popcount
except ImportError:  # CPU machines: the reference is used
    triton = None


def hash_topk_ref(codes, norms, qcodes, rbit: int, heads: torch.Tensor | None, k: int, offset: int = 0):
    return topk_ref(hash_scores_ref(codes, norms, qcodes, rbit, heads), k, offset)


if triton is not None:

    @triton.jit
    def _row_barrier(Counter, programs):
        """Every program of the row has arrived at Counter (each adds one, with release order for its earlier
        atomics; the poll acquires them)."""
        tl.debug_barrier()  # all threads' histogram atomics issued before this program's arrival
        tl.atomic_add(Counter, 1, sem="release", scope="gpu")
        while tl.atomic_add(Counter, 0, sem="acquire", scope="gpu") < programs:
            pass
        tl.debug_barrier()

    @triton.jit
    def _hash_topk_kernel(Codes, Norms, QCodes, Heads, Keys, Work, Out, T, K, offset, inv_rbit,
                          stride_cb, stride_ch, stride_ct, stride_nb, stride_nh, stride_qb, stride_qh, stride_qg,
                          stride_ob, stride_oh,
                          H: tl.constexpr, G: tl.constexpr, NW: tl.constexpr, NW_PAD: tl.constexpr,
                          SPAN: tl.constexpr, BLOCK_T: tl.constexpr, NATIVE: tl.constexpr):
        row = tl.program_id(0)  # sequence b, scored head j
        programs = tl.num_programs(1)
        rows = tl.num_programs(0)
        b = (row // H).to(tl.int64)
        j = row % H
        head = tl.load(Heads + j)
        lo = tl.program_id(1) * SPAN
        hi = tl.minimum(lo + SPAN, T)
        keys = Keys + row.to(tl.int64) * T
        w = tl.arange(0, NW_PAD)
        wmask = w < NW
        # 1. scores of this program's span, as keys whose unsigned order is the float order
        for t0 in range(lo, hi, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            tmask = t < hi
            kc = tl.load(Codes + b * stride_cb + head * stride_ch + t.to(tl.int64)[:, None] * stride_ct + w[None, :],
                         mask=tmask[:, None] & wmask[None, :], other=0)
            ham = tl.zeros([BLOCK_T, NW_PAD], tl.int32)
            for g in tl.static_range(G):
                qc = tl.load(QCodes + b * stride_qb + j * stride_qh + g * stride_qg + w, mask=wmask, other=0)
                ham += _popcount(kc ^ qc[None, :], NATIVE)
            norm = tl.load(Norms + b * stride_nb + head * stride_nh + t, mask=tmask, other=0.0)
            score = (G - 2.0 * tl.sum(ham, 1).to(tl.float32) * inv_rbit) * norm
            u = score.to(tl.uint32, bitcast=True)
            key = tl.where((u >> 31) != 0, ~u, u | 0x80000000)
            tl.store(keys + t, key.to(tl.int32, bitcast=True), mask=tmask)
        tl.debug_barrier()  # the span's keys are re-read by other threads of this program
        # 2. four radix passes, high byte first: the k-th largest key, and how many equal to it are still needed
        bins = tl.arange(0, 256)
        counters = Work + 4 * rows * 256 + row * 6  # 4 barrier counters, then 2 output cursors, per row
        prefix = tl.zeros([], tl.uint32)
        need = K
        for p in tl.static_range(4):
            counts = tl.zeros([256], tl.int32)
            for t0 in range(lo, hi, BLOCK_T):
                t = t0 + tl.arange(0, BLOCK_T)
                mask = t < hi
                key = tl.load(keys + t, mask=mask, other=0).to(tl.uint32, bitcast=True)
                if p > 0:
                    mask = mask & ((key >> (32 - 8 * p)) == prefix)
                counts += tl.histogram(((key >> (24 - 8 * p)) & 255).to(tl.int32), 256, mask=mask)
            hist = Work + (p * rows + row) * 256 + bins
            tl.atomic_add(hist, counts, mask=counts > 0, sem="relaxed", scope="gpu")
            _row_barrier(counters + p, programs)
            h = tl.load(hist, cache_modifier=".cg")  # the row's whole histogram (L2: written by atomics)
            higher = tl.cumsum(h, 0, reverse=True) - h  # keys in higher bins
            bsel = tl.min(tl.where(higher < need, bins, 256))  # the bin holding the need-th largest key
            need -= tl.sum(tl.where(bins == bsel, higher, 0))
            prefix = (prefix << 8) | bsel.to(tl.uint32)
        # 3. every key above the k-th, and as many equal to it as k still needs
        out = Out + b * stride_ob + j * stride_oh
        for t0 in range(lo, hi, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            mask = t < hi
            key = tl.load(keys + t, mask=mask, other=0).to(tl.uint32, bitcast=True)
            above = (mask & (key > prefix)).to(tl.int32)
            equal = (mask & (key == prefix)).to(tl.int32)
            at_above = tl.atomic_add(counters + 4, tl.sum(above, 0), sem="relaxed") + tl.cumsum(above, 0) - 1
            at_equal = tl.atomic_add(counters + 5, tl.sum(equal, 0), sem="relaxed") + tl.cumsum(equal, 0) - 1
            pos = t.to(tl.int64) + offset
            tl.store(out + at_above, pos, mask=above != 0)
            tl.store(out + (K - need) + at_equal, pos, mask=(equal != 0) & (at_equal < need))


def hash_topk_triton(codes: torch.Tensor, norms: torch.Tensor, qcodes: torch.Tensor, rbit: int,
                     heads: torch.Tensor | None, k: int, offset: int = 0, block_t: int = 1024, num_warps: int = 8,
                     programs: int | None = None) -> torch.Tensor:
    """programs: per row (default: the SM count shared by the rows, at least one each). More than the SM count
    in all is refused: the row barrier could wait for programs that cannot become resident."""
    b, hk, t, nbytes = codes.shape
    g = qcodes.shape[2]
    assert rbit % 32 == 0 and nbytes * 8 == rbit == qcodes.shape[3] * 8, "the kernel reads 32-bit words"
    assert 0 <= k <= t, (k, t)
    if heads is None:
        heads = torch.arange(hk, device=codes.device)
    h = heads.shape[0]
    assert qcodes.shape[:2] == (b, h) and norms.shape == (b, hk, t)
    out = torch.empty(b, h, k, dtype=torch.long, device=codes.device)
    if not (b and h and k):
        return out
    rows = b * h
    sms = torch.cuda.get_device_properties(codes.device).multi_processor_count if codes.is_cuda else 1
    programs = programs or max(1, sms // rows)
    assert programs == 1 or rows * programs <= sms, f"{rows} rows x {programs} programs exceed {sms} SMs"
    span = triton.cdiv(triton.cdiv(t, programs), block_t) * block_t
    programs = triton.cdiv(t, span)
    kw, qw = _words(codes), _words(qcodes)
    norms = norms if norms.stride(2) == 1 else norms.contiguous()
    keys = torch.empty(rows, t, dtype=torch.int32, device=codes.device)  # uint32 keys, bit for bit
    work = torch.zeros(PASSES * rows * BINS + 6 * rows, dtype=torch.int32, device=codes.device)
    nw = rbit // 32
    _hash_topk_kernel[(rows, programs)](
        kw, norms, qw, heads.contiguous(), keys, work, out, t, k, offset, 1.0 / rbit,
        kw.stride(0), kw.stride(1), kw.stride(2), norms.stride(0), norms.stride(1),
        qw.stride(0), qw.stride(1), qw.stride(2), out.stride(0), out.stride(1),
        H=h, G=g, NW=nw, NW_PAD=triton.next_power_of_2(nw), SPAN=span, BLOCK_T=block_t,
        NATIVE=os.environ.get("TRITON_INTERPRET") != "1", num_warps=num_warps)
    return out


def hash_topk(codes, norms, qcodes, rbit: int, heads: torch.Tensor | None, k: int, offset: int = 0):
    if codes.is_cuda and triton is not None and rbit % 32 == 0:
        return hash_topk_triton(codes, norms, qcodes, rbit, heads, k, offset)
    return hash_topk_ref(codes, norms, qcodes, rbit, heads, k, offset)
