"""A decode step's projections at BSZ 1: y = x W^T (+ b) for one row x, as one memory-bound Triton kernel; the
MLP's gate/up projection with SiLU(gate) * up in the same kernel; either with the RMSNorm before it (and the
residual addition before that) folded in, and the q/k projection with its RoPE after it, so that neither a norm
nor a rotation costs a launch of its own (a Llama-3-8B decode step had ~5 such small kernels per layer, ~2 us each
replayed from a graph).

Why not cuBLAS: at one row its GEMVs stream a Llama-3-8B layer's weights at ~3.4 of the 4.1 TB/s a device copy
reaches on the H200 (results/bench/README.md), and every system's decode step is mostly those bytes. Each
program here owns BLOCK_N output rows and streams them along K with wide loads, so the kernel is a plain
weight stream; the launch parameters come from experiments/tune_gemv.py. `linear_ref` / `linear_silu_mul_ref`
are the specification; the public functions take the kernel for one CUDA row and the reference otherwise
(prefill, batches, the CPU).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from clo.kernels.dense_ops import NATIVE, rms_norm_ref, rope_ref, silu_mul_ref

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU machines: the references are used
    triton = None


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def linear_silu_mul_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """weight [2I, K] (gate rows, then up rows) -> SiLU(x gate^T) * (x up^T), [..., I]."""
    return silu_mul_ref(F.linear(x, weight))


def norm_linear_ref(x: torch.Tensor, add: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False,
                    rope: tuple | None = None):
    """-> (projection of RMSNorm(x + add), x + add): rms_norm_ref, then linear_ref or linear_silu_mul_ref.
    rope = (position [1], inv_freq [D/2], heads): then rope_ref of the output's first `heads` heads of D rows."""
    h, s = rms_norm_ref(x, norm_weight, eps, add)
    y = linear_silu_mul_ref(h, weight) if gated else linear_ref(h, weight, bias)
    if rope is not None:
        position, inv_freq, heads = rope
        y = rope_ref(y.view(y.shape[0], -1, 2 * inv_freq.shape[0]), heads, position, inv_freq).view(y.shape)
    return y, s


def _one_cuda_row(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and x.numel() == x.shape[-1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return gemv_triton(x, weight, bias) if _one_cuda_row(x) else linear_ref(x, weight, bias)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return gemv_triton(x, weight, gated=True) if _one_cuda_row(x) else linear_silu_mul_ref(x, weight)


def norm_linear(x: torch.Tensor, add: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False,
                rope: tuple | None = None):
    """norm_linear_ref's result. The kernel normalises in fp32 and does not round the normed row to x's dtype
    before the product (the reference does, twice): the two differ by about a bf16 step of the output."""
    if _one_cuda_row(x) and norm_weight.dtype == x.dtype:
        s = torch.empty_like(x) if add is not None else x
        return gemv_triton(x, weight, bias, gated, norm=(add, norm_weight, eps, s), rope=rope), s
    return norm_linear_ref(x, add, norm_weight, eps, weight, bias, gated, rope)


def launch_params(gated: bool) -> tuple[int, int, int]:
    """(output rows per program, K per load, warps): the fastest or within 2% of it for every Llama-3-8B
    projection in experiments/tune_gemv.py's sweep on the H200 (results/bench/gemv_tuning.json). Few rows per
    program and long loads: many programs, each with KBs in flight; a gated program streams twice the rows."""
    return (4 if gated else 2), 1024, 4


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False,
                params: tuple[int, int, int] | None = None, norm: tuple | None = None,
                rope: tuple | None = None) -> torch.Tensor:
    """x [..., K] holding one row; weight [N, K] with unit stride along K. gated: N = 2I, returns
    SiLU(gate) * up [..., I]. norm = (add or None, norm weight [K], eps, sum): the row projected is
    RMSNorm(x + add) and the first program writes x + add to `sum`. rope = (position [1] on the device,
    inv_freq [D/2], heads): the output's first `heads` heads of D rows rotated as rope_ref does (each program
    then owns pairs of rows D/2 apart). params overrides launch_params (the tuning script's sweep)."""
    n, k = weight.shape
    if x.shape[-1] != k or weight.stride(1) != 1:
        raise ValueError(f"gemv: x [..., {x.shape[-1]}] against weight {tuple(weight.shape)} "
                         f"with strides {weight.stride()}")
    n_out = n // 2 if gated else n
    y = torch.empty(*x.shape[:-1], n_out, device=x.device, dtype=x.dtype)
    block_n, block_k, warps = params or launch_params(gated)
    add, norm_weight, eps, s = norm if norm is not None else (None, x, 0.0, x)
    position, inv_freq, rope_heads = rope if rope is not None else (x, x, 0)
    half = inv_freq.shape[0] if rope is not None else 1
    if rope is not None and (gated or n_out % (2 * half) or half % (block_n // 2) or block_n % 2):
        raise ValueError(f"gemv: RoPE needs whole heads of {2 * half} rows and pairs per program "
                         f"({n_out} rows, {block_n} per program{', gated' if gated else ''})")
    x1 = x.reshape(-1)
    _gemv_kernel[(triton.cdiv(n_out, block_n),)](
        x1, add.reshape(-1) if add is not None else x1, norm_weight, s.reshape(-1), eps, position,
        inv_freq.float().contiguous() if rope is not None else x, weight, bias if bias is not None else weight, y,
        n_out, k, weight.stride(0), NORM=norm is not None, HAS_ADD=add is not None, ROPE=rope is not None,
        ROPE_HEADS=rope_heads, HALF=half, NATIVE=NATIVE, HAS_BIAS=bias is not None, GATED=gated, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=warps)
    return y


if triton is not None:

    @triton.jit
    def _gemv_kernel(X, Add, NormW, Sum, eps, Pos, Inv, W, Bias, Y, N, K, stride_w, NORM: tl.constexpr,
                     HAS_ADD: tl.constexpr, ROPE: tl.constexpr, ROPE_HEADS: tl.constexpr, HALF: tl.constexpr,
                     NATIVE: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        if ROPE:  # BLOCK_N / 2 pairs of rows (j, j + HALF) of one head, interleaved: rotated together at the end
            i = tl.arange(0, BLOCK_N)
            head, j0 = pid // (HALF // (BLOCK_N // 2)), pid % (HALF // (BLOCK_N // 2)) * (BLOCK_N // 2)
            rows = head * 2 * HALF + j0 + i // 2 + (i % 2) * HALF
        else:
            rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        cols = tl.arange(0, BLOCK_K)
        ssq = tl.zeros([BLOCK_K], dtype=tl.float32)  # NORM: the sum of squares of x + add, along the same loop
        w_rows = W + rows.to(tl.int64)[:, None] * stride_w
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # gated: the up rows, N rows further on
        for k0 in range(0, K, BLOCK_K):
            col_ok = k0 + cols < K
            x = tl.load(X + k0 + cols, mask=col_ok, other=0.0)
            if HAS_ADD:  # rounded to x's dtype, as the torch addition is; the first program keeps the sum
                x = (x.to(tl.float32) + tl.load(Add + k0 + cols, mask=col_ok, other=0.0).to(tl.float32))
                x = x.to(Sum.dtype.element_ty)
                if tl.program_id(0) == 0:
                    tl.store(Sum + k0 + cols, x, mask=col_ok)
            x = x.to(tl.float32)
            if NORM:  # RMSNorm(x) W^T = rsqrt(mean(x^2) + eps) * (x * norm weight) W^T: the scale comes last
                ssq += x * x
                x = x * tl.load(NormW + k0 + cols, mask=col_ok, other=0.0).to(tl.float32)
            x = x[None, :]
            mask = row_ok[:, None] & col_ok[None, :]
            # the weights are read once per step: do not let them push x out of the cache
            w = tl.load(w_rows + k0 + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
            acc += w.to(tl.float32) * x
            if GATED:
                u = tl.load(w_rows + N * stride_w + k0 + cols[None, :], mask=mask, other=0.0,
                            eviction_policy="evict_first")
                acc_up += u.to(tl.float32) * x
        y = tl.sum(acc, axis=1)
        up = tl.sum(acc_up, axis=1)
        if NORM:
            scale = tl.rsqrt(tl.sum(ssq, axis=0) / K + eps)
            y, up = y * scale, up * scale
        if HAS_BIAS:
            y += tl.load(Bias + rows, mask=row_ok, other=0.0).to(tl.float32)
        if ROPE:  # rope_ref on the rounded projection, in fp32 with its cos/sin tables rounded to the output's dtype
            if head < ROPE_HEADS:
                y1, y2 = tl.split(tl.reshape(y.to(Y.dtype.element_ty).to(tl.float32), [BLOCK_N // 2, 2]))
                f = tl.load(Pos).to(tl.float32) * tl.load(Inv + j0 + tl.arange(0, BLOCK_N // 2))
                if NATIVE:  # accurate at the large angles of long contexts (see dense_ops' rope kernel)
                    c, s = libdevice.cos(f), libdevice.sin(f)
                else:
                    c, s = tl.cos(f), tl.sin(f)
                c = c.to(Y.dtype.element_ty).to(tl.float32)
                s = s.to(Y.dtype.element_ty).to(tl.float32)
                y = tl.reshape(tl.join(y1 * c - y2 * s, y2 * c + y1 * s), [BLOCK_N])
        if GATED:  # rounded where silu_mul_ref rounds: the projections, SiLU(gate), the product
            g = y.to(Y.dtype.element_ty).to(tl.float32)
            up = up.to(Y.dtype.element_ty).to(tl.float32)
            y = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32) * up
        tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)
