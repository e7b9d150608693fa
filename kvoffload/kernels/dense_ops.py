"""The decoder's small elementwise steps, one kernel each on the GPU: RMSNorm (with the residual addition before
it), rotary embedding of a decode step's q and k, and SiLU(gate) * up.

At BSZ 1 a layer's decode work is a few GEMVs and, written in torch, dozens of small kernels (a norm alone is
seven: cast, pow, mean, add, rsqrt, mul, mul). Replayed from a CUDA graph each small kernel still costs a launch
and a drain, which outweigh its few KB of work: with these kernels and the fused projections a Llama-3-8B layer's
dense work comes close to the time its weights take to stream (results/bench/README.md). Each `*_ref`
below is the specification (the arithmetic of the torch code it replaces, rounding included); the public
functions pick the Triton kernel for CUDA tensors and the reference elsewhere.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU machines: the references are used
    triton = None

# The interpreter has no libdevice; there tl.cos/tl.sin are numpy's, which are accurate at large angles too
NATIVE = os.environ.get("TRITON_INTERPRET") != "1"


def _use_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


# ---- references --------------------------------------------------------------------------------------------
def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] int -> cos, sin: [T, head_dim] in `dtype` (computed in fp32, as HF does)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., T, head_dim]; cos/sin broadcast over the leading dims."""
    return x * cos + rotate_half(x) * sin


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, add: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (RMSNorm(x + add), x + add): HF Llama's norm, in fp32 and rounded to x's dtype before the weight."""
    if add is not None:
        x = x + add
    dtype = x.dtype
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(dtype), x


def rope_ref(x: torch.Tensor, heads: int, position: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [B, >= heads, D]: rotates the first `heads` heads in place, all at position[0] (one decode step)."""
    cos, sin = cos_sin(position[:1], inv_freq, x.dtype)
    x[:, :heads] = apply_rotary(x[:, :heads], cos, sin)
    return x


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] (gate, then up) -> [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- dispatch ----------------------------------------------------------------------------------------------
def rms_norm(x, weight, eps, add=None):
    return (rms_norm_triton if _use_triton(x) else rms_norm_ref)(x, weight, eps, add)


def rms_norm_pair(x, weight, weight2, eps, add=None):
    """-> (RMSNorm_weight(x + add), x + add, RMSNorm_weight2(x + add)): one kernel for two layers' norms of the same
    input (a layer's input norm and the next layer's, for CLO's speculative query)."""
    if _use_triton(x):
        return rms_norm_triton(x, weight, eps, add, weight2)
    y, s = rms_norm_ref(x, weight, eps, add)
    return y, s, rms_norm_ref(s, weight2, eps)[0]


def rope(x, heads, position, inv_freq):
    return (rope_triton if _use_triton(x) else rope_ref)(x, heads, position, inv_freq)


def silu_mul(gate_up):
    return (silu_mul_triton if _use_triton(gate_up) else silu_mul_ref)(gate_up)


# ---- kernels -----------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        X,
        Add,
        W,
        Y,
        Sum,
        W2,
        Y2,
        N,
        eps,
        stride_x,
        stride_a,
        stride_y,
        stride_s,
        stride_y2,
        HAS_ADD: tl.constexpr,
        HAS_W2: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        col = tl.arange(0, BLOCK)
        m = col < N
        x = tl.load(X + row * stride_x + col, mask=m, other=0.0)
        if HAS_ADD:  # rounded to x's dtype before the norm, as the torch addition is
            x = x.to(tl.float32) + tl.load(Add + row * stride_a + col, mask=m, other=0.0).to(tl.float32)
            x = x.to(Sum.dtype.element_ty)
            tl.store(Sum + row * stride_s + col, x, mask=m)
        xf = x.to(tl.float32)
        y = (xf * tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)).to(Sum.dtype.element_ty)
        w = tl.load(W + col, mask=m, other=0.0)
        tl.store(Y + row * stride_y + col, (w.to(tl.float32) * y.to(tl.float32)).to(Y.dtype.element_ty), mask=m)
        if HAS_W2:  # a second norm of the same x (another layer's weight)
            w2 = tl.load(W2 + col, mask=m, other=0.0)
            tl.store(Y2 + row * stride_y2 + col, (w2.to(tl.float32) * y.to(tl.float32)).to(Y2.dtype.element_ty), mask=m)

    @triton.jit
    def _rope_kernel(X, Pos, Inv, stride_b, stride_h, HEADS: tl.constexpr, HALF: tl.constexpr, NATIVE: tl.constexpr):
        b = (tl.program_id(0) // HEADS).to(tl.int64)
        h = tl.program_id(0) % HEADS
        i = tl.arange(0, HALF)
        f = tl.load(Pos).to(tl.float32) * tl.load(Inv + i)
        if NATIVE:  # the accurate cos/sin (range-reduced, as torch's): angles reach 1e6 rad at long contexts
            c, s = libdevice.cos(f), libdevice.sin(f)
        else:
            c, s = tl.cos(f), tl.sin(f)
        c = c.to(X.dtype.element_ty).to(tl.float32)  # the reference's cos/sin tables are in x's dtype
        s = s.to(X.dtype.element_ty).to(tl.float32)
        base = X + b * stride_b + h * stride_h
        x1 = tl.load(base + i).to(tl.float32)
        x2 = tl.load(base + HALF + i).to(tl.float32)
        tl.store(base + i, (x1 * c - x2 * s).to(X.dtype.element_ty))
        tl.store(base + HALF + i, (x2 * c + x1 * s).to(X.dtype.element_ty))

    @triton.jit
    def _silu_mul_kernel(GU, Out, I, stride_g, stride_o, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = col < I
        g = tl.load(GU + row * stride_g + col, mask=m, other=0.0).to(tl.float32)
        u = tl.load(GU + row * stride_g + I + col, mask=m, other=0.0).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(Out.dtype.element_ty).to(tl.float32)  # F.silu rounds its output
        tl.store(Out + row * stride_o + col, (silu * u).to(Out.dtype.element_ty), mask=m)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., N] -> [rows, N] with unit stride along N (a view when x allows it)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def rms_norm_triton(x, weight, eps, add=None, weight2=None):
    shape, n = x.shape, x.shape[-1]
    x2 = _rows(x)
    a2 = _rows(add) if add is not None else x2
    y = torch.empty(x2.shape, dtype=torch.result_type(weight, x), device=x.device)
    s = torch.empty_like(x2) if add is not None else x2
    y2 = torch.empty(x2.shape, dtype=torch.result_type(weight2, x), device=x.device) if weight2 is not None else y
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            a2,
            weight,
            y,
            s,
            weight2 if weight2 is not None else weight,
            y2,
            n,
            eps,
            x2.stride(0),
            a2.stride(0),
            y.stride(0),
            s.stride(0),
            y2.stride(0),
            HAS_ADD=add is not None,
            HAS_W2=weight2 is not None,
            BLOCK=triton.next_power_of_2(n),
            num_warps=4 if n <= 4096 else 8,
        )
    out = y.view(shape), (s.view(shape) if add is not None else x)
    return out if weight2 is None else (*out, y2.view(shape))


def rope_triton(x, heads, position, inv_freq):
    b, _, d = x.shape
    assert d % 2 == 0 and (d // 2) & (d // 2 - 1) == 0 and x.stride(2) == 1, "head_dim a power of two, unit stride"
    if b and heads:
        _rope_kernel[(b * heads,)](
            x,
            position,
            inv_freq.float().contiguous(),
            x.stride(0),
            x.stride(1),
            HEADS=heads,
            HALF=d // 2,
            NATIVE=NATIVE,
            num_warps=1,
        )
    return x


def silu_mul_triton(gate_up):
    shape = gate_up.shape
    inter = shape[-1] // 2
    g2 = _rows(gate_up)
    out = torch.empty(g2.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if g2.shape[0]:
        _silu_mul_kernel[(g2.shape[0], triton.cdiv(inter, block))](
            g2, out, inter, g2.stride(0), out.stride(0), BLOCK=block
        )
    return out.view(*shape[:-1], inter)
