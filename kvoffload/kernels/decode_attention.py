"""Decode attention over a token-major KV buffer whose valid length per sequence is read from the device, so
one launch serves every step and can be replayed from a CUDA graph (flash-decoding: split the keys over
many programs, then merge the partial softmaxes).

  q        [B, H, D]
  k, v     [B, T, Hkv, D]   (T = buffer capacity; only the first lengths[b] tokens are attended)
  lengths  [B] int          (on the device)
  -> out   [B, H, D]

`decode_attention_ref` is the specification (plain torch, runs anywhere); `decode_attention` picks the Triton
kernel on CUDA and the reference elsewhere. With return_lse, each also returns the log-sum-exp of the scores
[B, H] (fp32), so that attention over several buffers can be computed per buffer and merged exactly
(`merge_attention`). `hybrid_attention` is CLO's: its window, its cache slots and its persistent heads' rows at
their top-k indices, each read where it lies, in one split launch and one merge. `SplitAttention` launches the
split per range of KV heads, so that parts can run on different streams before the one merge.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kvoffload.kernels.decode_attention_fp8 import dequantize_second, launch_fp8_split

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: the reference is used
    triton = None


def decode_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    return_lse: bool = False,
    rows: torch.Tensor | None = None,
):
    """rows [B, T, Hkv] bool, when given: only those rows (within the length) are attended."""
    b, h, d = q.shape
    hkv = k.shape[2]
    qg = q.view(b, hkv, h // hkv, d).float()
    scores = torch.einsum("bkgd,btkd->bkgt", qg, k.float()) / math.sqrt(d)
    valid = torch.arange(k.shape[1], device=k.device)[None, :, None] < lengths[:, None, None]  # [B, T, 1]
    valid = valid if rows is None else valid & rows  # [B, T, Hkv]
    valid = valid.expand(b, k.shape[1], hkv)
    scores = scores.masked_fill(~valid.permute(0, 2, 1)[:, :, None, :], float("-inf"))
    vf = v.float().masked_fill(~valid[..., None], 0.0)  # rows past the length may hold garbage (NaN)
    out = torch.einsum("bkgt,btkd->bkgd", scores.softmax(-1), vf).reshape(b, h, d).to(q.dtype)
    if return_lse:
        return out, scores.logsumexp(-1).reshape(b, h)
    return out


def merge_attention(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Exact attention over the union of disjoint key sets from per-set (out [B, H, D], lse [B, H])."""
    lse = torch.stack([p[1] for p in parts])  # [P, B, H]
    w = torch.softmax(lse, dim=0)[..., None]
    # a part with no keys for a sequence has weight 0 and output NaN (softmax over nothing): it adds nothing
    return (torch.stack([p[0].float() for p in parts]).nan_to_num(0.0) * w).sum(0).to(parts[0][0].dtype)


if triton is not None:

    @triton.jit
    def _query_head(QHeads, kvh, MAPPED: tl.constexpr):
        """The KV head of q whose queries KV head kvh of the buffers serves (itself unless MAPPED)."""
        qh = kvh
        if MAPPED:
            qh = tl.load(QHeads + kvh)
        return qh

    @triton.jit
    def _split_kernel(
        Q,
        QHeads,
        K,
        V,
        Lens,
        K2,
        V2,
        Lens2,
        PK,
        PV,
        Idx,
        NC,
        H0,
        NH,
        Out,
        M,
        L,
        sm_scale,
        stride_qb,
        stride_qh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        stride_k2b,
        stride_k2t,
        stride_k2h,
        stride_v2b,
        stride_v2t,
        stride_v2h,
        stride_pkb,
        stride_pkt,
        stride_pkh,
        stride_pvb,
        stride_pvt,
        stride_pvh,
        stride_ib,
        stride_ih,
        HKV: tl.constexpr,
        G: tl.constexpr,
        G_PAD: tl.constexpr,
        D: tl.constexpr,
        SPLITS: tl.constexpr,
        SPLIT_LEN: tl.constexpr,
        SPLITS1: tl.constexpr,
        SPLIT_LEN2: tl.constexpr,
        TWO: tl.constexpr,
        INDIRECT: tl.constexpr,
        MAPPED: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SKIP2: tl.constexpr = False,
    ):
        """Splits 0..SPLITS1-1 cover the first buffer, the rest (TWO) the second: one launch for both. With
        INDIRECT, KV heads NC.. take the second buffer's rows from PK/PV (their head kvh - NC) at the token indices
        Idx: a persistent head's selected rows are read where they lie, not gathered first. A launch covers KV
        heads H0..H0+NH-1 (SplitAttention.split). With MAPPED, KV head kvh of the buffers reads the queries of
        head QHeads[kvh] of Q (the merge writes its output there): no permuted copy of the queries. With SKIP2 the
        second buffer's heads below NC are FP8 (decode_attention_fp8.py's kernel runs their splits after this one):
        their splits here attend nothing."""
        split = tl.program_id(1)
        # int64: a batch of long sequences spans more than 2^31 elements (check_offsets bounds the rest)
        b = (tl.program_id(0) // NH).to(tl.int64)
        kvh = H0 + (tl.program_id(0) % NH).to(tl.int64)
        bh = b * HKV + kvh
        k_ptr = K + b * stride_kb + kvh * stride_kh
        v_ptr = V + b * stride_vb + kvh * stride_vh
        stride_t, stride_u = stride_kt, stride_vt
        length = tl.load(Lens + b)
        start = split * SPLIT_LEN
        span = SPLIT_LEN
        idx_ptr = Idx
        indexed_end = length * 0  # rows below it are at Idx[n] (none, unless INDIRECT), the rest at n
        if TWO:
            if split >= SPLITS1:
                k_ptr = K2 + b * stride_k2b + kvh * stride_k2h
                v_ptr = V2 + b * stride_v2b + kvh * stride_v2h
                stride_t, stride_u = stride_k2t, stride_v2t
                length = tl.load(Lens2 + b)
                start = (split - SPLITS1) * SPLIT_LEN2
                span = SPLIT_LEN2
                if INDIRECT:
                    if kvh >= NC:
                        hp = kvh - NC
                        k_ptr = PK + b * stride_pkb + hp * stride_pkh
                        v_ptr = PV + b * stride_pvb + hp * stride_pvh
                        stride_t, stride_u = stride_pkt, stride_pvt
                        idx_ptr = Idx + b * stride_ib + hp * stride_ih
                        indexed_end = length
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        qh = _query_head(QHeads, kvh, MAPPED)
        q = tl.load(
            Q + b * stride_qb + (qh * G + g)[:, None] * stride_qh + d[None, :], mask=(g < G)[:, None], other=0.0
        )
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        end = tl.minimum(start + span, length)
        if SKIP2:
            end = tl.where((split >= SPLITS1) & (kvh < NC), start, end)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            valid = n < end
            at_idx = n < tl.minimum(end, indexed_end)
            rows = tl.where(at_idx, tl.load(idx_ptr + n, mask=at_idx, other=0).to(tl.int32), n)
            valid = valid & (rows >= 0)  # a negative index is no row (RetroInfer's padding in a partial block)
            kb = tl.load(k_ptr + rows[:, None] * stride_t + d[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(kb)) * sm_scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vb = tl.load(v_ptr + rows[:, None] * stride_u + d[None, :], mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
            m_i = m_new
        # only the G real query rows (the G_PAD - G padding rows tl.dot needs stay in registers)
        row = (bh * SPLITS + split) * G + g
        tl.store(Out + row[:, None] * D + d[None, :], acc, mask=(g < G)[:, None])
        tl.store(M + row, m_i, mask=g < G)
        tl.store(L + row, l_i, mask=g < G)

    @triton.jit
    def _merge_kernel(
        Out,
        M,
        L,
        O,
        Lse,
        QHeads,
        stride_ob,
        stride_oh,
        HKV: tl.constexpr,
        G: tl.constexpr,
        D: tl.constexpr,
        SPLITS: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
        CHUNK: tl.constexpr,
        MAPPED: tl.constexpr,
    ):
        """One program per query head, all its splits' maxima and sums in one load: the merge is a few loads
        deep, not one chain of loads per split (a serial loop over the splits waits on each split's loads in
        turn, on the layer's critical path)."""
        bhg = tl.program_id(0)
        bh = bhg // G
        g = bhg % G
        b = bh // HKV
        kvh = bh % HKV
        s = tl.arange(0, SPLITS_PAD)
        rows = (bh * SPLITS + s) * G + g
        m = tl.load(M + rows, mask=s < SPLITS, other=float("-inf"))
        m_all = tl.max(m, 0)
        m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
        w = tl.exp(m - m_safe)  # empty splits: exp(-inf) = 0
        l_all = tl.sum(tl.load(L + rows, mask=s < SPLITS, other=0.0) * w, 0)
        d = tl.arange(0, D)
        c = tl.arange(0, CHUNK)
        acc = tl.zeros([D], tl.float32)
        for s0 in range(0, SPLITS, CHUNK):
            sc = s0 + c
            wc = tl.exp(tl.load(M + (bh * SPLITS + sc) * G + g, mask=sc < SPLITS, other=float("-inf")) - m_safe)
            part = tl.load(
                Out + ((bh * SPLITS + sc) * G + g)[:, None] * D + d[None, :], mask=(sc < SPLITS)[:, None], other=0.0
            )
            acc += tl.sum(part * wc[:, None], 0)
        qh = _query_head(QHeads, kvh, MAPPED)
        tl.store(O + b * stride_ob + (qh * G + g) * stride_oh + d, (acc / l_all).to(O.dtype.element_ty))
        tl.store(Lse + (b * HKV + qh) * G + g, m_safe + tl.log(l_all))


def _splits(batch_kv_heads: int, capacity: int, block_n: int, programs: int = 512) -> tuple[int, int]:
    """About `programs` programs (the default: ~4 per SM on 132 SMs), each at least one block long."""
    splits = max(1, min(triton.cdiv(capacity, block_n), triton.cdiv(programs, batch_kv_heads)))
    split_len = triton.cdiv(triton.cdiv(capacity, splits), block_n) * block_n
    return triton.cdiv(capacity, split_len), split_len


class SplitAttention:
    """decode_attention_triton in parts: split(h0, h1) launches the split kernel for KV heads h0..h1-1, merge()
    combines every head's splits. Parts may run on different streams (CLO: the cached heads' part while the
    persistent heads' top-k is still being selected), ordered before merge() by the caller, who also keeps the
    inputs and this object alive until every part has run.

    `second` = (k2, v2, lengths2): attention over the union of both buffers. indexed_heads > 0: the last
    indexed_heads KV heads take their second-buffer rows from pk/pv at idx (split's `indexed`, hybrid_attention's
    form); k2/v2 then hold only the heads before them. q_heads [Hkv] long: KV head j of the buffers serves the
    query heads of KV head q_heads[j] of q, and the output is in q's order (CLO's stores keep their heads
    permuted). second_scales = (ks2, vs2, keep2): the second buffer's heads before the indexed ones are FP8, k2/v2
    their e4m3 bits (uint8) and ks2/vs2 [B, T2, nc] their scales (decode_attention_fp8.py), keep2 [B, T2, nc] bool
    or None the rows attended."""

    def __init__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        lengths: torch.Tensor,
        second: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        indexed_heads: int = 0,
        block_n: int = 64,
        num_warps: int = 4,
        q_heads: torch.Tensor | None = None,
        programs: int = 512,
        second_scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    ):
        b, h, d = q.shape
        self.hkv = hkv = k.shape[2]
        self.g = h // hkv
        self.nc = hkv - indexed_heads
        k2, v2, lengths2 = second if second is not None else (k, v, lengths)
        assert q.stride(2) == k.stride(3) == v.stride(3) == k2.stride(3) == v2.stride(3) == 1, (
            "head_dim must be the contiguous dimension"
        )
        self.scales = second_scales
        assert k2.shape[0] == b and k2.shape[2] == self.nc
        assert k2.dtype == (torch.uint8 if second_scales is not None else k.dtype)
        assert b and k.shape[1] and k2.shape[1], "no sequence, or a buffer with no rows (hybrid_attention skips it)"
        check_offsets(k, v, k2, v2)
        # the kernel reads lengths[b] at offset b: no broadcast (stride 0) views
        self.first, self.second = (q, k, v, lengths.contiguous()), (k2, v2, lengths2.contiguous())
        splits1, self.split_len = _splits(b * hkv, k.shape[1], block_n, programs)
        splits2, self.split_len2 = _splits(b * hkv, k2.shape[1], block_n, programs) if second is not None else (0, 1)
        self.splits1, self.splits, self.two = splits1, splits1 + splits2, second is not None
        self.part = torch.empty(b * hkv * self.splits * self.g, d, dtype=torch.float32, device=q.device)
        self.m = torch.empty(b * hkv * self.splits * self.g, dtype=torch.float32, device=q.device)
        self.l_ = torch.empty_like(self.m)
        self.out = torch.empty_like(q)
        self.lse = torch.empty(b, h, dtype=torch.float32, device=q.device)
        self.block_n, self.num_warps = block_n, num_warps
        assert q_heads is None or (q_heads.shape == (hkv,) and q_heads.device == q.device)
        self.q_heads = q_heads

    def split(self, h0: int, h1: int, indexed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        q, k, v, lengths = self.first
        k2, v2, lengths2 = self.second
        b, _, d = q.shape
        assert 0 <= h0 < h1 <= self.hkv, (h0, h1)
        assert (indexed is not None) == (h1 > self.nc), "indices exactly when the range holds indexed heads"
        pk, pv, idx = indexed if indexed is not None else (k, v, lengths.view(b, 1, -1))
        if indexed is not None:
            assert idx.shape == (b, self.hkv - self.nc, k2.shape[1]) and idx.stride(2) == 1, (
                "one index per second-buffer row"
            )
            assert pk.shape[0] == b and pk.shape[2:] == pv.shape[2:] == (self.hkv - self.nc, d)
            assert pk.stride(3) == pv.stride(3) == 1 and pk.dtype == pv.dtype == k.dtype
            check_offsets(pk, pv)
        if self.scales is not None:  # the FP8 heads' second buffer is read by launch_fp8_split, not here
            k2, v2 = k, v
        _split_kernel[(b * (h1 - h0), self.splits)](
            q,
            self._heads(),
            k,
            v,
            lengths,
            k2,
            v2,
            lengths2,
            pk,
            pv,
            idx,
            self.nc,
            h0,
            h1 - h0,
            self.part,
            self.m,
            self.l_,
            1.0 / math.sqrt(d),
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            k.stride(2),
            v.stride(0),
            v.stride(1),
            v.stride(2),
            k2.stride(0),
            k2.stride(1),
            k2.stride(2),
            v2.stride(0),
            v2.stride(1),
            v2.stride(2),
            pk.stride(0),
            pk.stride(1),
            pk.stride(2),
            pv.stride(0),
            pv.stride(1),
            pv.stride(2),
            idx.stride(0),
            idx.stride(1),
            HKV=self.hkv,
            G=self.g,
            G_PAD=max(16, triton.next_power_of_2(self.g)),  # tl.dot needs at least 16 rows; G of them are stored
            D=d,
            SPLITS=self.splits,
            SPLIT_LEN=self.split_len,
            SPLITS1=self.splits1,
            SPLIT_LEN2=self.split_len2,
            TWO=self.two,
            INDIRECT=indexed is not None,
            MAPPED=self.q_heads is not None,
            BLOCK_N=self.block_n,
            num_warps=self.num_warps,
            SKIP2=self.scales is not None,
        )
        if self.scales is not None and h0 < self.nc:
            launch_fp8_split(self, h0, min(h1, self.nc))

    def _heads(self) -> torch.Tensor:
        return self.q_heads if self.q_heads is not None else self.lse  # unread without MAPPED

    def merge(self) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, d = self.out.shape
        splits_pad = triton.next_power_of_2(self.splits)
        _merge_kernel[(b * h,)](
            self.part,
            self.m,
            self.l_,
            self.out,
            self.lse,
            self._heads(),
            self.out.stride(0),
            self.out.stride(1),
            HKV=self.hkv,
            G=self.g,
            D=d,
            SPLITS=self.splits,
            SPLITS_PAD=splits_pad,
            CHUNK=min(32, splits_pad),
            MAPPED=self.q_heads is not None,
        )
        return self.out, self.lse


def check_offsets(*buffers: torch.Tensor) -> None:
    """x [B, T, Hkv, D]: the kernel offsets a sequence and a head in int64, a row within them in int32."""
    for x in buffers:
        assert (x.shape[1] - 1) * x.stride(1) + (x.shape[3] - 1) * x.stride(3) < 2**31, (
            "a KV buffer's rows span 2^31 elements or more: the attention kernel's int32 row offsets would overflow"
        )


def decode_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    block_n: int = 64,
    num_warps: int = 4,
    return_lse: bool = False,
    second: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    indexed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    q_heads: torch.Tensor | None = None,
    programs: int = 512,
    second_scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
):
    """Every head in one split launch and one merge (SplitAttention's arguments)."""
    parts = SplitAttention(
        q,
        k,
        v,
        lengths,
        second,
        indexed[2].shape[1] if indexed is not None else 0,
        block_n,
        num_warps,
        q_heads,
        programs,
        second_scales,
    )
    parts.split(0, parts.hkv, indexed)
    out, lse = parts.merge()
    return (out, lse) if return_lse else out


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, return_lse: bool = False
):
    if q.is_cuda and triton is not None:
        return decode_attention_triton(q, k, v, lengths, return_lse=return_lse)
    n = uniform_length(lengths)
    if not q.is_cuda and not return_lse and n:
        return sdpa_cpu(q, k[:, :n].transpose(1, 2), v[:, :n].transpose(1, 2))
    return decode_attention_ref(q, k, v, lengths, return_lse)


def uniform_length(lengths: torch.Tensor) -> int:
    """The one length of every sequence of a CPU lengths tensor, 0 when they differ (or on another device: the CPU
    paths below need it on the host, where reading it costs nothing)."""
    if lengths.is_cuda or not lengths.numel():
        return 0
    n = int(lengths[0])
    return n if bool((lengths == n).all()) else 0


def sdpa_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [B, H, D] over every row of k, v [B, Hkv, N, D] (keep [B, Hkv, 1, N] bool: only those rows)
    in one torch SDPA call, fp32 as the reference computes: the CPU path of decode_attention and hybrid_attention,
    their references' results up to float rounding (the reference masks the whole buffer and merges the parts'
    softmaxes in a dozen torch calls per buffer)."""
    b, h, d = q.shape
    hkv = k.shape[1]
    qg = q.view(b, hkv, h // hkv, d).float()
    out = torch.nn.functional.scaled_dot_product_attention(qg, k.float(), v.float(), attn_mask=keep)
    return out.reshape(b, h, d).to(q.dtype)


def gather_indexed(
    second: tuple[torch.Tensor, torch.Tensor, torch.Tensor], indexed: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
):
    """The second buffer with the indexed heads' rows appended as heads (what the kernel reads in place):
    pk, pv [B, T, Hp, D], idx [B, Hp, k] -> row i of head nc + j is pk[b, idx[b, j, i], j]; and which rows
    are rows at all ([B, k, Hkv] bool: a negative index is none)."""
    k2, v2, lengths2 = second
    pk, pv, idx = indexed
    at = idx.clamp(min=0).transpose(1, 2)[..., None].expand(-1, -1, -1, pk.shape[-1])  # [B, k, Hp, D]
    rows = torch.cat([torch.ones(k2.shape[:3], dtype=torch.bool, device=idx.device), idx.transpose(1, 2) >= 0], 2)
    return (torch.cat([k2, pk.gather(1, at)], 2), torch.cat([v2, pv.gather(1, at)], 2), lengths2), rows


def hybrid_attention(
    q: torch.Tensor,
    first: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    second: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    indexed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    q_heads: torch.Tensor | None = None,
    second_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Exact attention over the union of two KV buffers, each (k, v, lengths) as decode_attention takes them, read where
    they lie (docs/systems.md, "Hybrid attention"). `indexed` = (pk, pv, idx): the last Hp KV heads' second-buffer rows
    are pk/pv [B, T, Hp, D] at the token indices idx [B, Hp, k] (a negative index: no row, not attended; CLO's
    persistent heads: their full KV on the device, read at their top-k); `second` then holds the other heads. On CUDA
    one split kernel covers both and one merge combines them; the specification is the indexed rows gathered
    (`gather_indexed`), then per-buffer attention merged by log-sum-exp (`merge_attention`). q_heads: as
    SplitAttention's (the specification permutes q's head groups, attends, and puts the output back in q's order).
    second_scales = (ks, vs): `second` is FP8 (kv_dtype=fp8: e4m3 bits and their scales, decode_attention_fp8.py),
    dequantised in the kernel's registers on CUDA, by `dequantize_second` (the specification) elsewhere."""
    empty = first[0].shape[1] == 0 or second[0].shape[1] == 0  # no rows at all: the kernel needs both buffers
    if q.is_cuda and triton is not None and not empty:
        scales = None if second_scales is None else (*second_scales, None)
        return decode_attention_triton(q, *first, second=second, indexed=indexed, q_heads=q_heads, second_scales=scales)
    if second_scales is not None:
        second = dequantize_second(second, second_scales, q.dtype)
    if not q.is_cuda and uniform_length(first[2]) and uniform_length(second[2]):
        return hybrid_attention_cpu(q, first, second, indexed, q_heads)
    return hybrid_attention_ref(q, first, second, indexed, q_heads)


def in_head_order(q: torch.Tensor, q_heads: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor]):
    """attend() of q with its head groups permuted by q_heads (the buffers' KV-head order), its output put back in
    q's order."""
    b, h, d = q.shape
    groups = q.view(b, q_heads.shape[0], -1, d)
    out = attend(groups[:, q_heads].reshape(b, h, d))
    return out.view(groups.shape)[:, q_heads.argsort()].reshape(b, h, d)


def hybrid_attention_cpu(
    q: torch.Tensor,
    first: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    second: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    indexed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    q_heads: torch.Tensor | None = None,
) -> torch.Tensor:
    """hybrid_attention_ref's result up to float rounding, for CPU tensors whose buffers each have one length > 0
    for every sequence: the valid rows of both buffers (the indexed ones gathered, as the reference does) in one
    buffer, attended by one SDPA call."""
    if q_heads is not None:  # the reference's permutation: exact
        return in_head_order(q, q_heads, lambda qp: hybrid_attention_cpu(qp, first, second, indexed))
    b = q.shape[0]
    rows = None
    if indexed is not None:
        second, rows = gather_indexed(second, indexed)
    n1, n2 = uniform_length(first[2]), uniform_length(second[2])
    k = torch.cat([first[0][:, :n1], second[0][:, :n2]], 1).transpose(1, 2)  # [B, Hkv, n1 + n2, D]
    v = torch.cat([first[1][:, :n1], second[1][:, :n2]], 1).transpose(1, 2)
    keep = None
    if rows is not None and not bool(rows[:, :n2].all()):
        keep = torch.cat([rows.new_ones(b, n1, rows.shape[2]), rows[:, :n2]], 1).transpose(1, 2)[:, :, None]
    return sdpa_cpu(q, k, v, keep)


def hybrid_attention_ref(
    q: torch.Tensor,
    first: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    second: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    indexed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    q_heads: torch.Tensor | None = None,
) -> torch.Tensor:
    """hybrid_attention's specification (see there)."""
    empty = first[0].shape[1] == 0 or second[0].shape[1] == 0
    if q_heads is not None:
        return in_head_order(q, q_heads, lambda qp: hybrid_attention_ref(qp, first, second, indexed))
    rows = None
    if indexed is not None:
        second, rows = gather_indexed(second, indexed)
    if first[0].shape[1] == 0:
        return decode_attention(q, *second) if rows is None else decode_attention_ref(q, *second, rows=rows)
    if empty:
        return decode_attention(q, *first)
    return merge_attention(
        [decode_attention_ref(q, *first, return_lse=True), decode_attention_ref(q, *second, True, rows)]
    )


def attend_packed(
    q: torch.Tensor,
    first: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    rows: torch.Tensor,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """A baseline's attention under kv_dtype=fp8: q [B, H, D] over the model-dtype `first` (its window, as
    decode_attention takes it) and the FP8 rows it selected, rows [B, Hkv, k, 2, D + 2] packed (fp8_rows.py), keep
    [B, Hkv, k] bool or None the rows that are tokens. On CUDA one split launch reads the rows' bytes and dequantises
    them in registers; elsewhere the reference: the rows dequantised, then attended with the window."""
    d = q.shape[-1]
    lengths2 = torch.full((rows.shape[0],), rows.shape[2], dtype=torch.long, device=rows.device)
    k8, v8 = rows[:, :, :, 0, :d].transpose(1, 2), rows[:, :, :, 1, :d].transpose(1, 2)
    ks, vs = (rows[:, :, :, j, d:].view(torch.float16)[..., 0].transpose(1, 2) for j in (0, 1))
    keep2 = None if keep is None else keep.transpose(1, 2)
    if q.is_cuda and triton is not None and first[0].shape[1] and rows.shape[2]:
        return decode_attention_triton(q, *first, second=(k8, v8, lengths2), second_scales=(ks, vs, keep2))
    k2, v2, _ = dequantize_second((k8, v8, lengths2), (ks, vs), q.dtype)
    if first[0].shape[1] == 0:
        return decode_attention_ref(q, k2, v2, lengths2, rows=keep2)
    return merge_attention(
        [decode_attention_ref(q, *first, return_lse=True), decode_attention_ref(q, k2, v2, lengths2, True, keep2)]
    )
