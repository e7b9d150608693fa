"""The decode-step GEMV kernel (plain, with bias, with SiLU(gate) * up fused) against its torch reference, in the
Triton interpreter (TRITON_INTERPRET=1) and on the GPU; the dispatch keeps everything but one CUDA row on torch."""

import os

import pytest
import torch

from kvoffload.kernels.gemv import (
    linear,
    linear_pair,
    linear_pair_ref,
    linear_ref,
    linear_silu_mul,
    linear_silu_mul_ref,
)
from tests.reference import randn

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpreter = pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1 to run the kernels on the CPU")
gpu = pytest.mark.gpu


def check(device, n, k, dtype, bias, gated, params=None):
    """One row against the reference on the same inputs. Plain: against the fp32 product, which the kernel's fp32
    sums round once (a bf16 step of outputs of size ~sqrt(k)). Gated: against the reference's own roundings
    (the projections, SiLU, the product): a step in one of them moves the result by up to three steps, more where
    the interpreter truncates instead of rounding."""
    from kvoffload.kernels.gemv import gemv_triton

    x, w = randn(1, 1, k, seed=1, dtype=dtype, device=device), randn(n, k, seed=2, dtype=dtype, device=device)
    b = randn(n, seed=3, dtype=dtype, device=device) if bias else None
    got = gemv_triton(x, w, b, gated=gated, params=params).cpu()
    want = (
        linear_silu_mul_ref(x.cpu(), w.cpu()).float()
        if gated
        else linear_ref(x.cpu().float(), w.cpu().float(), None if b is None else b.cpu().float())
    )
    assert got.shape == (1, 1, n // 2 if gated else n) and got.dtype == dtype and not got.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2**-7 if not gated else 2**-5 if device == "cpu" else 2**-6
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * k**0.5)


def check_pair(device, n1, k1, n2, k2, dtype, bias):
    """Two projections written into one buffer: each part equals the kernel's own output for it, bit for bit,
    and the reference within check's tolerance."""
    from kvoffload.kernels.gemv import gemv_triton, linear_pair_triton

    x1, x2 = randn(1, 1, k1, seed=1, dtype=dtype, device=device), randn(1, 1, k2, seed=2, dtype=dtype, device=device)
    w1, w2 = randn(n1, k1, seed=3, dtype=dtype, device=device), randn(n2, k2, seed=4, dtype=dtype, device=device)
    b1, b2 = (
        (randn(n1, seed=5, dtype=dtype, device=device), randn(n2, seed=6, dtype=dtype, device=device))
        if bias
        else (None, None)
    )
    got = linear_pair_triton(x1, w1, b1, x2, w2, b2)
    assert got.shape == (1, 1, n1 + n2) and got.dtype == dtype
    assert torch.equal(got, torch.cat([gemv_triton(x1, w1, b1), gemv_triton(x2, w2, b2)], -1))
    want = linear_pair_ref(*(t.cpu().float() if t is not None else None for t in (x1, w1, b1, x2, w2, b2)))
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.cpu().float(), want, rtol=tol, atol=tol * max(k1, k2) ** 0.5)


@interpreter
@pytest.mark.parametrize(
    "n1,k1,n2,k2,bias", [(24, 1024, 13, 700, False), (1, 64, 1, 64, True), (5, 300, 40, 300, False)]
)
def test_gemv_pair_interpreted(n1, k1, n2, k2, bias):
    check_pair("cpu", n1, k1, n2, k2, torch.bfloat16, bias)


@gpu
@pytest.mark.parametrize(
    "n1,k1,n2,k2,dtype,bias",
    [
        (4096, 4096, 6144, 4096, torch.bfloat16, False),  # Llama-3-8B: the next layer's q, then this layer's q/k/v
        (5120, 5120, 7168, 5120, torch.bfloat16, True),  # Qwen2.5-14B, with biases
        (7, 576, 1000, 576, torch.float32, True),
        (1, 64, 1, 64, torch.bfloat16, True),
    ],
)
def test_gemv_pair_triton_matches_ref(n1, k1, n2, k2, dtype, bias):
    check_pair("cuda", n1, k1, n2, k2, dtype, bias)


def test_linear_pair_dispatch():
    """Anything but one CUDA row each is the reference (on the CPU: exactly the two F.linear results)."""
    x1, w1, x2, w2 = randn(2, 1, 32), randn(8, 32, seed=1), randn(2, 1, 16, seed=2), randn(4, 16, seed=3)
    assert torch.equal(linear_pair(x1, w1, None, x2, w2, None), torch.cat([linear_ref(x1, w1), linear_ref(x2, w2)], -1))


@interpreter
@pytest.mark.parametrize("n,k,bias,gated", [(24, 1024, False, False), (13, 700, True, False), (40, 600, False, True)])
def test_gemv_interpreted(n, k, bias, gated):  # 13 x 700: masked rows and a masked last step along K
    check("cpu", n, k, torch.bfloat16, bias, gated)


@gpu
@pytest.mark.parametrize(
    "n,k,dtype,bias,gated",
    [
        (6144, 4096, torch.bfloat16, False, False),  # Llama-3-8B q/k/v
        (4096, 14336, torch.bfloat16, False, False),  # down
        (28672, 4096, torch.bfloat16, False, True),  # gate/up with SiLU-multiply
        (7168, 5120, torch.bfloat16, True, False),  # Qwen2.5-14B q/k/v, with bias
        (1000, 576, torch.float32, True, False),  # masked rows, fp32
        (30, 1000, torch.bfloat16, False, True),
    ],
)  # masked everything, gated
def test_gemv_triton_matches_ref(n, k, dtype, bias, gated):
    check("cuda", n, k, dtype, bias, gated)


@gpu
@pytest.mark.parametrize("params", [(4, 256, 4), (16, 512, 8), (2, 1024, 4)])
def test_gemv_triton_matches_ref_at_other_launch_params(params):
    check("cuda", 4096, 4096, torch.bfloat16, False, False, params)
    check("cuda", 2048, 4096, torch.bfloat16, False, True, params)


@gpu
def test_dispatch_uses_the_kernel_for_one_row_only():
    x, w = randn(2, 1, 256, device="cuda"), randn(64, 256, seed=4, device="cuda")
    torch.testing.assert_close(linear(x, w), linear_ref(x, w))  # two rows: torch
    torch.testing.assert_close(linear_silu_mul(x, w), linear_silu_mul_ref(x, w))
    torch.testing.assert_close(linear(x[:1], w), linear_ref(x[:1], w), rtol=2**-7, atol=0.2)


def test_dispatch_on_cpu_is_the_reference():
    x, w, b = randn(3, 1, 32), randn(8, 32, seed=1), randn(8, seed=2)
    assert torch.equal(linear(x, w, b), linear_ref(x, w, b))
    assert torch.equal(linear_silu_mul(x[:1], w), linear_silu_mul_ref(x[:1], w))


def test_shape_mismatch_is_a_clear_error():
    from kvoffload.kernels.gemv import gemv_triton

    with pytest.raises(ValueError, match="gemv"):
        gemv_triton(randn(1, 1, 32), randn(8, 16))
