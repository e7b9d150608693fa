"""Decode attention over FP8 rows (kv_dtype=fp8, docs/fp8.md): the second buffer of a split launch (CLO's slots, a
baseline's selected rows) in packed FP8 (kvoffload/kernels/fp8_rows.py), read and dequantised in registers.

  k8, v8   [B, T, Hkv, D] uint8   e4m3 bits of K and V (views of a packed buffer: no copy)
  ks, vs   [B, T, Hkv] fp16       their per-row scales (views of the same buffer)
  keep     [B, T, Hkv] bool       optional: only those rows are attended (RetroInfer-style's partial blocks)

`dequantize_second` is the specification: the rows dequantised (e4m3 * scale, in fp32) into the model's dtype, then
attended as any second buffer is (decode_attention.py's references). On CUDA `launch_fp8_split` runs the split of
`SplitAttention` over those rows: it loads the bytes, converts them (natively from compute capability 8.9, by integer
decoding below it and in Triton's interpreter), applies the K scale to the scores and the V scale to the softmax
weights, and writes its partial softmaxes where the model-dtype split would have, so the one merge is unchanged. No
dequantised copy of the rows is ever written.
"""

from __future__ import annotations

import os

import torch

from kvoffload.kernels.fp8_rows import fp8_dtype

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: the reference is used
    triton = None


def dequantize_second(
    second: tuple[torch.Tensor, torch.Tensor, torch.Tensor], scales: tuple[torch.Tensor, torch.Tensor], dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k8, v8, lengths) with (ks, vs) -> (k, v, lengths) in dtype: the reference's rows."""
    k8, v8, lengths = second
    ks, vs = scales
    k = (k8.view(fp8_dtype()).float() * ks.float()[..., None]).to(dtype)
    v = (v8.view(fp8_dtype()).float() * vs.float()[..., None]).to(dtype)
    return k, v, lengths


def native_fp8(device: torch.device) -> bool:
    """Whether the GPU converts e4m3 in hardware (compute capability 8.9 and up); the interpreter does not."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


if triton is not None:

    @triton.jit
    def _e4m3(x, NATIVE: tl.constexpr):
        """uint8 bits of e4m3fn -> fp32. NATIVE: the hardware conversion; else sign, exponent (bias 7) and mantissa
        decoded with integer ops (no NaN: quantize_rows clamps to +-448)."""
        if NATIVE:
            out = x.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            u = x.to(tl.int32)
            e = (u >> 3) & 15
            m = (u & 7).to(tl.float32)
            mag = tl.where(e == 0, m * 0.001953125, (m + 8.0) * tl.exp2((e - 10).to(tl.float32)))
            out = tl.where(u >= 128, -mag, mag)
        return out

    @triton.jit
    def _fp8_split_kernel(
        Q,
        QHeads,
        K8,
        V8,
        KS,
        VS,
        Keep,
        Lens2,
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
        stride_ksb,
        stride_kst,
        stride_ksh,
        stride_vsb,
        stride_vst,
        stride_vsh,
        stride_eb,
        stride_et,
        stride_eh,
        HKV: tl.constexpr,
        G: tl.constexpr,
        G_PAD: tl.constexpr,
        D: tl.constexpr,
        SPLITS: tl.constexpr,
        SPLITS1: tl.constexpr,
        SPLIT_LEN2: tl.constexpr,
        MAPPED: tl.constexpr,
        KEEP: tl.constexpr,
        NATIVE: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """Split SPLITS1 + program_id(1) of KV head H0 + program_id(0) % NH: _split_kernel's second-buffer split,
        the rows FP8 (see the module's docstring)."""
        s2 = tl.program_id(1)
        split = SPLITS1 + s2
        b = (tl.program_id(0) // NH).to(tl.int64)
        kvh = H0 + (tl.program_id(0) % NH).to(tl.int64)
        bh = b * HKV + kvh
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        qh = kvh
        if MAPPED:
            qh = tl.load(QHeads + kvh)
        q = tl.load(
            Q + b * stride_qb + (qh * G + g)[:, None] * stride_qh + d[None, :], mask=(g < G)[:, None], other=0.0
        )
        k_ptr = K8 + b * stride_kb + kvh * stride_kh
        v_ptr = V8 + b * stride_vb + kvh * stride_vh
        ks_ptr = KS + b * stride_ksb + kvh * stride_ksh
        vs_ptr = VS + b * stride_vsb + kvh * stride_vsh
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        start = s2 * SPLIT_LEN2
        end = tl.minimum(start + SPLIT_LEN2, tl.load(Lens2 + b))
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            valid = n < end
            if KEEP:
                keep = tl.load(Keep + b * stride_eb + n * stride_et + kvh * stride_eh, mask=valid, other=0)
                valid = valid & (keep != 0)
            kb = _e4m3(tl.load(k_ptr + n[:, None] * stride_kt + d[None, :], mask=valid[:, None], other=0), NATIVE)
            ks = tl.load(ks_ptr + n * stride_kst, mask=valid, other=0.0).to(tl.float32)
            # the K scale on the scores (one multiply a row), not on the D values of each row
            s = tl.dot(q, tl.trans(kb.to(q.dtype))) * (ks * sm_scale)[None, :]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vb = _e4m3(tl.load(v_ptr + n[:, None] * stride_vt + d[None, :], mask=valid[:, None], other=0), NATIVE)
            vs = tl.load(vs_ptr + n * stride_vst, mask=valid, other=0.0).to(tl.float32)
            # the V scale on the weights: sum_n p_n * (vs_n * v8_n) = sum_n (p_n * vs_n) * v8_n
            acc = acc * alpha[:, None] + tl.dot((p * vs[None, :]).to(q.dtype), vb.to(q.dtype))
            m_i = m_new
        row = (bh * SPLITS + split) * G + g
        tl.store(Out + row[:, None] * D + d[None, :], acc, mask=(g < G)[:, None])
        tl.store(M + row, m_i, mask=g < G)
        tl.store(L + row, l_i, mask=g < G)


def launch_fp8_split(parts, h0: int, h1: int) -> None:
    """The FP8 second-buffer splits of KV heads h0..h1-1 of a SplitAttention `parts` made with second_scales, into
    its partial arrays (after its model-dtype launch for the same heads, which leaves those splits empty)."""
    q = parts.first[0]
    k8, v8, lengths2 = parts.second
    ks, vs, keep = parts.scales
    b, _, d = q.shape
    keep_t = keep if keep is not None else lengths2.view(b, 1, 1)  # unread without KEEP
    keep_t = keep_t.view(torch.uint8) if keep_t.dtype == torch.bool else keep_t
    heads = parts.q_heads if parts.q_heads is not None else parts.lse  # unread without MAPPED
    _fp8_split_kernel[(b * (h1 - h0), parts.splits - parts.splits1)](
        q,
        heads,
        k8,
        v8,
        ks,
        vs,
        keep_t,
        lengths2,
        h0,
        h1 - h0,
        parts.part,
        parts.m,
        parts.l_,
        1.0 / d**0.5,
        q.stride(0),
        q.stride(1),
        *k8.stride()[:3],
        *v8.stride()[:3],
        *ks.stride(),
        *vs.stride(),
        *keep_t.stride()[:3],
        HKV=parts.hkv,
        G=parts.g,
        G_PAD=max(16, triton.next_power_of_2(parts.g)),
        D=d,
        SPLITS=parts.splits,
        SPLITS1=parts.splits1,
        SPLIT_LEN2=parts.split_len2,
        MAPPED=parts.q_heads is not None,
        KEEP=keep is not None,
        NATIVE=native_fp8(q.device),
        BLOCK_N=parts.block_n,
        num_warps=parts.num_warps,
    )
