"""Hash scores of HATA-style retrieval (docs/systems.md, "Retrieval"): one pass over the packed key codes and key norms.

  codes   [B, Hk, T, rbit/8] uint8  sign bits of the keys (bit i of byte j = bit 8j + i)
  norms   [B, Hk, T] fp32            |k|
  qcodes  [B, h, G, rbit/8] uint8    sign bits of the G queries of each scored KV head
  heads   [h] long, optional         which of the Hk KV heads to score (default: all, h = Hk); reading the
                                     selected heads in place spares the copy that codes[:, heads] would make
  miss    [B, nc] bool, optional     CLO's lookup result for the first nc scored heads: a head that hit reuses
                                     its cached rows, so the kernel neither reads its codes nor writes its
                                     scores (left unset); heads nc.. are always scored
  hist    [>= B*h*256] int32, optional  zeroed (radix_topk.radix_work): the kernel also counts the first pass
                                     of the radix select over the scores it writes (their keys' top byte, row
                                     b*h + j), so that the select does not read them once more for it
  -> scores [B, h, T] fp32 = (G - 2 * sum_g popcount(qcode_g XOR code) / rbit) * norm

`hash_scores_ref` is the specification (the arithmetic of `HashRetriever.scores`); `hash_scores` picks the
Triton kernel on CUDA, the compiled distances of hash_score_cpu on the CPU (rbit % 64 == 0) and the reference
elsewhere. The Triton kernel reads codes as int32 words (rbit % 32 == 0), so each key costs rbit/8 + 4 bytes read
and 4 written: it is memory bound when popcount is one instruction.
`encode_query_triton` makes the query codes in one kernel (projection, signs, packing): in torch that is eight
small kernels on a layer's critical path, for a few KB of work; `HashRetriever.encode` is its specification.
"""

from __future__ import annotations

import os

import torch

from kvoffload.kernels import hash_score_cpu
from kvoffload.kernels.radix_keys import count_first_pass_ref, miss_rows

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from kvoffload.kernels.radix_keys import needed, order_key
except ImportError:  # CPU machines: the reference is used
    triton = None


_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int16)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """[..., rbit] float -> [..., rbit / 8] uint8, bit i of byte j = (x[8j + i] > 0)."""
    bits = (x > 0).to(torch.uint8).unflatten(-1, (-1, 8))
    weights = 1 << torch.arange(8, device=x.device, dtype=torch.uint8)
    return (bits * weights).sum(-1, dtype=torch.uint8)


def hamming(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Popcount of a XOR b over the last dim (uint8 bytes) -> int32."""
    table = _POPCOUNT.to(a.device)
    return table[(a ^ b).long()].sum(-1, dtype=torch.int32)


def hash_scores_ref(
    codes: torch.Tensor, norms: torch.Tensor, qcodes: torch.Tensor, rbit: int, heads: torch.Tensor | None = None
) -> torch.Tensor:
    if heads is not None:
        codes, norms = codes[:, heads], norms[:, heads]
    ham = hamming(qcodes[:, :, :, None, :], codes[:, :, None, :, :]).sum(2)  # [B, h, T], summed over G
    return (qcodes.shape[2] - 2.0 * ham.float() / rbit) * norms


def block_max(scores: torch.Tensor, pool: int) -> torch.Tensor:
    """scores [..., T] per token -> [..., ceil(T / pool)]: each block of `pool` tokens scores its best token; a
    partial last block by its real tokens (its padding is no candidate). hash_scores(pool=)'s reference."""
    if pool == 1:
        return scores
    n = scores.shape[-1]
    full = n // pool
    best = scores[..., : full * pool].unflatten(-1, (full, pool)).amax(-1)
    if n % pool:
        best = torch.cat([best, scores[..., full * pool :].amax(-1, keepdim=True)], dim=-1)
    return best


if triton is not None:

    @triton.jit
    def _popcount(x, NATIVE: tl.constexpr):
        if NATIVE:
            return libdevice.popc(x)
        # SWAR bit count, for the interpreter (which has no libdevice); unsigned so shifts are logical
        u = x.to(tl.uint32, bitcast=True)
        u = u - ((u >> 1) & 0x55555555)
        u = (u & 0x33333333) + ((u >> 2) & 0x33333333)
        u = (u + (u >> 4)) & 0x0F0F0F0F
        return ((u * 0x01010101) >> 24).to(tl.int32)

    @triton.jit
    def _hash_score_kernel(
        Codes,
        Norms,
        QCodes,
        Heads,
        Miss,
        NC,
        Out,
        Hist,
        T,
        TB,
        inv_rbit,
        stride_cb,
        stride_ch,
        stride_ct,
        stride_nb,
        stride_nh,
        stride_qb,
        stride_qh,
        stride_qg,
        stride_ob,
        stride_oh,
        H: tl.constexpr,
        G: tl.constexpr,
        NW: tl.constexpr,
        NW_PAD: tl.constexpr,
        BLOCK_T: tl.constexpr,
        NATIVE: tl.constexpr,
        HAS_MISS: tl.constexpr,
        COUNT: tl.constexpr,
        POOL: tl.constexpr,
    ):
        bj = tl.program_id(0)
        b = (bj // H).to(tl.int64)
        j = bj % H
        head = tl.load(Heads + j)
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = t < T
        if HAS_MISS:
            tmask = tl.where(needed(Miss, b, j, NC), tmask, False)  # not &: the interpreter refuses that mask
        w = tl.arange(0, NW_PAD)
        wmask = w < NW  # padded words are 0 in both codes: they add nothing
        kc = tl.load(
            Codes + b * stride_cb + head * stride_ch + t.to(tl.int64)[:, None] * stride_ct + w[None, :],
            mask=tmask[:, None] & wmask[None, :],
            other=0,
        )
        ham = tl.zeros([BLOCK_T, NW_PAD], tl.int32)
        for g in tl.static_range(G):
            qc = tl.load(QCodes + b * stride_qb + j * stride_qh + g * stride_qg + w, mask=wmask, other=0)
            ham += _popcount(kc ^ qc[None, :], NATIVE)
        ham = tl.sum(ham, 1)  # one reduction over the words, not one per query head
        norm = tl.load(Norms + b * stride_nb + head * stride_nh + t, mask=tmask, other=0.0)
        score = (G - 2.0 * ham.to(tl.float32) * inv_rbit) * norm
        if POOL > 1:  # each block of POOL tokens scores its best real token (block_max)
            score = tl.max(tl.reshape(tl.where(tmask, score, float("-inf")), (BLOCK_T // POOL, POOL)), 1)
            t = tl.program_id(1) * (BLOCK_T // POOL) + tl.arange(0, BLOCK_T // POOL)
            live = t < TB
            if HAS_MISS:
                live = tl.where(needed(Miss, b, j, NC), live, False)
            tmask = live
        tl.store(Out + b * stride_ob + j * stride_oh + t, score, mask=tmask)
        if COUNT:  # the radix select's first pass (_histogram_kernel with P = 0), from the scores in registers
            counts = tl.histogram((order_key(score) >> 24).to(tl.int32), 256, mask=tmask)
            tl.atomic_add(Hist + bj * 256 + tl.arange(0, 256), counts, mask=counts > 0, sem="relaxed")

    @triton.jit
    def _encode_query_kernel(
        Q,
        W,
        Heads,
        Out,
        stride_qb,
        stride_qh,
        stride_wh,
        stride_wd,
        stride_ob,
        stride_oh,
        stride_og,
        H: tl.constexpr,
        G: tl.constexpr,
        G_PAD: tl.constexpr,
        D: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        """One program per (sequence, KV head, 32-bit word): 32 projections of the group's queries, as signs."""
        bj = tl.program_id(0)
        w = tl.program_id(1)
        b = bj // H
        j = bj % H
        head = tl.load(Heads + j)
        g = tl.arange(0, G_PAD)
        bit = tl.arange(0, 32)
        x = tl.zeros([G_PAD, 32], tl.float32)
        for d0 in tl.static_range(0, D, CHUNK):  # multiply-add in registers: a few KB of work, no tensor cores
            d = d0 + tl.arange(0, CHUNK)
            q = tl.load(
                Q + b * stride_qb + (head * G + g)[:, None] * stride_qh + d[None, :], mask=(g < G)[:, None], other=0.0
            ).to(tl.float32)
            proj = tl.load(W + head * stride_wh + d[:, None] * stride_wd + (w * 32 + bit)[None, :])  # [CHUNK, 32]
            x += tl.sum(q[:, :, None] * proj[None, :, :], 1)
        word = tl.sum((x > 0).to(tl.uint32) << bit.to(tl.uint32)[None, :], 1)  # distinct bits: sum == or
        tl.store(Out + b * stride_ob + j * stride_oh + g * stride_og + w, word.to(tl.int32, bitcast=True), mask=g < G)


def encode_query_triton(
    q: torch.Tensor, proj: torch.Tensor, heads: torch.Tensor, group: int, chunk: int | None = None
) -> torch.Tensor:
    """q [B, H, D] (H = Hkv * group), proj [Hkv, D, rbit] fp32 (one layer's), heads [h] -> the codes of the
    group's queries of each KV head in `heads`, [B, h, group, rbit / 8] uint8 (bytes as `pack_signs` makes)."""
    b, _, d = q.shape
    rbit = proj.shape[2]
    h = heads.shape[0]
    assert rbit % 32 == 0 and d & (d - 1) == 0 and proj.stride(2) == 1 and q.stride(2) == 1
    out = torch.empty(b, h, group, rbit // 32, dtype=torch.int32, device=q.device)
    g_pad = triton.next_power_of_2(group)
    # head_dim per step: the whole of it in one step when the group is small (the fastest at Llama-3 shape in
    # experiments/bench/tune_retrieval_kernels.py's sweep: results/bench/README.md), capped so the products fit in
    # registers
    chunk = chunk or min(d, max(16, 512 // g_pad))
    assert chunk & (chunk - 1) == 0, f"chunk={chunk}: a power of two"
    if b and h:
        _encode_query_kernel[(b * h, rbit // 32)](
            q,
            proj,
            heads.contiguous(),
            out,
            q.stride(0),
            q.stride(1),
            proj.stride(0),
            proj.stride(1),
            out.stride(0),
            out.stride(1),
            out.stride(2),
            H=h,
            G=group,
            G_PAD=g_pad,
            D=d,
            CHUNK=min(d, chunk),
        )
    return out.view(torch.uint8)  # little-endian: byte j of word w holds projections 32w + 8j .. 32w + 8j + 7


def _words(x: torch.Tensor) -> torch.Tensor:
    """uint8 codes -> int32 words over the same bytes (bit order is irrelevant to a popcount of an XOR)."""
    x = (
        x
        if x.stride(-1) == 1 and all(s % 4 == 0 for s in x.stride()[:-1]) and x.storage_offset() % 4 == 0
        else x.contiguous()
    )
    return x.view(torch.int32)


POOL_TILE = 256  # hash_scores_triton's default tokens per program; hash_scores pools in the kernel where it divides


def hash_scores_triton(
    codes: torch.Tensor,
    norms: torch.Tensor,
    qcodes: torch.Tensor,
    rbit: int,
    heads: torch.Tensor | None = None,
    block_t: int = POOL_TILE,
    num_warps: int = 4,
    miss: torch.Tensor | None = None,
    hist: torch.Tensor | None = None,
    pool: int = 1,
) -> torch.Tensor:
    """[B, h, T] scores, or with pool > 1 [B, h, ceil(T / pool)] block maxima (block_max), in one launch."""
    b, hk, t, nbytes = codes.shape
    g = qcodes.shape[2]
    assert rbit % 32 == 0 and nbytes * 8 == rbit == qcodes.shape[3] * 8, "the kernel reads 32-bit words"
    if heads is None:
        heads = torch.arange(hk, device=codes.device)
    h = heads.shape[0]
    assert qcodes.shape[:2] == (b, h) and norms.shape == (b, hk, t)
    kw, qw = _words(codes), _words(qcodes)
    norms = norms if norms.stride(2) == 1 else norms.contiguous()
    assert block_t % pool == 0, (block_t, pool)
    tb = triton.cdiv(t, pool)
    out = torch.empty(b, h, tb, dtype=torch.float32, device=codes.device)
    if not (b and h and t):
        return out
    nw = rbit // 32
    grid = (b * h, triton.cdiv(t, block_t))
    miss_u8, nc = miss_rows(miss, b, norms)
    assert hist is None or (hist.dtype == torch.int32 and hist.numel() >= b * h * 256), "hist: radix_work's"
    _hash_score_kernel[grid](
        kw,
        norms,
        qw,
        heads.contiguous(),
        miss_u8,
        nc,
        out,
        hist if hist is not None else out,
        t,
        tb,
        1.0 / rbit,
        kw.stride(0),
        kw.stride(1),
        kw.stride(2),
        norms.stride(0),
        norms.stride(1),
        qw.stride(0),
        qw.stride(1),
        qw.stride(2),
        out.stride(0),
        out.stride(1),
        H=h,
        G=g,
        NW=nw,
        NW_PAD=triton.next_power_of_2(nw),
        BLOCK_T=block_t,
        NATIVE=os.environ.get("TRITON_INTERPRET") != "1",
        HAS_MISS=miss is not None,
        COUNT=hist is not None,
        POOL=pool,
        num_warps=num_warps,
    )
    return out


def hash_scores(
    codes: torch.Tensor,
    norms: torch.Tensor,
    qcodes: torch.Tensor,
    rbit: int,
    heads: torch.Tensor | None = None,
    miss: torch.Tensor | None = None,
    hist: torch.Tensor | None = None,
    pool: int = 1,
) -> torch.Tensor:
    """miss: the kernel's (rows of hit heads left unset); the reference scores every row. hist: the kernel's (the
    reference counts it in torch). pool: block maxima of `pool` tokens (block_max). On the CPU the distances are
    compiled (hash_score_cpu: the reference's scores, bit for bit)."""
    if codes.is_cuda and triton is not None and rbit % 32 == 0:
        if POOL_TILE % pool == 0:  # the kernel pools within its tiles of tokens
            return hash_scores_triton(codes, norms, qcodes, rbit, heads, miss=miss, hist=hist, pool=pool)
        assert miss is None, "pool does not divide the kernel's tile: the rows are pooled in torch, all of them"
        scores = hash_scores_triton(codes, norms, qcodes, rbit, heads)
    elif hash_score_cpu.runs(codes, rbit):
        scores = hash_score_cpu.hash_scores_cpu(codes, norms, qcodes, rbit, heads)
    else:
        scores = hash_scores_ref(codes, norms, qcodes, rbit, heads)
    return count_first_pass_ref(block_max(scores, pool), hist)
