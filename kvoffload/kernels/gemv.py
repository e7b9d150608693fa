"""A decode step's projections at BSZ 1: y = x W^T (+ b) for one row x, as one memory-bound Triton kernel, and
the MLP's gate/up projection with SiLU(gate) * up in the same kernel.

Why not cuBLAS: every system's decode step is mostly the bytes of its weights, and at one row cuBLAS's GEMVs
stream a Llama-3-8B layer's weights well below the bandwidth a device copy reaches, slower than this kernel
(results/bench/README.md). Each program here owns BLOCK_N output rows and streams them along K with wide loads,
so the kernel is a plain weight stream; the launch parameters come from experiments/bench/tune_gemv.py. `linear_ref` /
`linear_silu_mul_ref` are the specification; the public functions take the kernel for one CUDA row (and a weight
contiguous along K) and the reference otherwise (prefill, batches, the CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvoffload.kernels.dense_ops import silu_mul_ref

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: the references are used
    triton = None


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def linear_silu_mul_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """weight [2I, K] (gate rows, then up rows) -> SiLU(x gate^T) * (x up^T), [..., I]."""
    return silu_mul_ref(F.linear(x, weight))


def _one_cuda_row(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and x.numel() == x.shape[-1] and weight.stride(-1) == 1


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return gemv_triton(x, weight, bias) if _one_cuda_row(x, weight) else linear_ref(x, weight, bias)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return gemv_triton(x, weight, gated=True) if _one_cuda_row(x, weight) else linear_silu_mul_ref(x, weight)


def linear_pair_ref(
    x1: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    x2: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
) -> torch.Tensor:
    return torch.cat([F.linear(x1, w1, b1), F.linear(x2, w2, b2)], dim=-1)


def linear_pair(
    x1: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    x2: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
) -> torch.Tensor:
    """[x1 W1^T (+ b1), x2 W2^T (+ b2)] in one tensor: at one CUDA row each kernel writes its part of one buffer,
    so what follows treats both as one (CLO's speculative query and q/k/v share one RoPE launch)."""
    if _one_cuda_row(x1, w1) and _one_cuda_row(x2, w2):
        return linear_pair_triton(x1, w1, b1, x2, w2, b2)
    return linear_pair_ref(x1, w1, b1, x2, w2, b2)


def linear_pair_triton(x1, w1, b1, x2, w2, b2) -> torch.Tensor:
    n1 = w1.shape[0]
    y = torch.empty(*x1.shape[:-1], n1 + w2.shape[0], device=x1.device, dtype=x1.dtype)
    gemv_triton(x1, w1, b1, out=y[..., :n1])
    gemv_triton(x2, w2, b2, out=y[..., n1:])
    return y


def launch_params(gated: bool) -> tuple[int, int, int]:
    """(output rows per program, K per load, warps): the fastest, or close to it, for every Llama-3-8B
    projection in experiments/bench/tune_gemv.py's sweep (results/bench/README.md). Few rows per program and long
    loads: many programs, each with KBs in flight; a gated program streams twice the rows."""
    return (4 if gated else 2), 1024, 4


def gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gated: bool = False,
    params: tuple[int, int, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] holding one row; weight [N, K] with unit stride along K. gated: N = 2I, returns
    SiLU(gate) * up [..., I]. params overrides launch_params (the tuning script's sweep). out: where to write
    (one row of the output's size, unit stride), else a new tensor."""
    n, k = weight.shape
    if x.shape[-1] != k or weight.stride(1) != 1:
        raise ValueError(
            f"gemv: x [..., {x.shape[-1]}] against weight {tuple(weight.shape)} with strides {weight.stride()}"
        )
    n_out = n // 2 if gated else n
    y = out if out is not None else torch.empty(*x.shape[:-1], n_out, device=x.device, dtype=x.dtype)
    assert y.numel() == n_out and y.stride(-1) == 1 and y.dtype == x.dtype, "out: one row of the output, unit stride"
    block_n, block_k, warps = params or launch_params(gated)
    _gemv_kernel[(triton.cdiv(n_out, block_n),)](
        x.reshape(-1),
        weight,
        bias if bias is not None else weight,
        y,
        n_out,
        k,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        GATED=gated,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
    )
    return y


if triton is not None:

    @triton.jit
    def _gemv_kernel(
        X,
        W,
        Bias,
        Y,
        N,
        K,
        stride_w,
        HAS_BIAS: tl.constexpr,
        GATED: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        cols = tl.arange(0, BLOCK_K)
        w_rows = W + rows.to(tl.int64)[:, None] * stride_w
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # gated: the up rows, N rows further on
        for k0 in range(0, K, BLOCK_K):
            col_ok = k0 + cols < K
            x = tl.load(X + k0 + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            mask = row_ok[:, None] & col_ok[None, :]
            # the weights are read once per step: do not let them push x out of the cache
            w = tl.load(w_rows + k0 + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
            acc += w.to(tl.float32) * x
            if GATED:
                u = tl.load(
                    w_rows + N * stride_w + k0 + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first"
                )
                acc_up += u.to(tl.float32) * x
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(Bias + rows, mask=row_ok, other=0.0).to(tl.float32)
        if GATED:  # rounded where silu_mul_ref rounds: the projections, SiLU(gate), the product
            g = y.to(Y.dtype.element_ty).to(tl.float32)
            up = tl.sum(acc_up, axis=1).to(Y.dtype.element_ty).to(tl.float32)
            y = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32) * up
        tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)
