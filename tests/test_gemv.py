"""The decode-step GEMV kernel (plain, with bias, with SiLU(gate) * up fused) against its torch reference, in the
Triton interpreter (TRITON_INTERPRET=1) and on the GPU; the dispatch keeps everything but one CUDA row on torch."""
import os

import pytest
import torch

from clo.kernels.gemv import linear, linear_ref, linear_silu_mul, linear_silu_mul_ref, norm_linear, norm_linear_ref

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpreter = pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1 to run the kernels on the CPU")
gpu = pytest.mark.gpu


def randn(*shape, seed=0, dtype=torch.bfloat16, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def check(device, n, k, dtype, bias, gated, params=None):
    """One row against the reference on the same inputs. Plain: against the fp32 product, which the kernel's fp32
    sums round once (a bf16 step of outputs of size ~sqrt(k)). Gated: against the reference's own roundings
    (the projections, SiLU, the product): a step in one of them moves the result by up to three steps, more where
    the interpreter truncates instead of rounding."""
    from clo.kernels.gemv import gemv_triton

    x, w = randn(1, 1, k, seed=1, dtype=dtype, device=device), randn(n, k, seed=2, dtype=dtype, device=device)
    b = randn(n, seed=3, dtype=dtype, device=device) if bias else None
    got = gemv_triton(x, w, b, gated=gated, params=params).cpu()
    want = (linear_silu_mul_ref(x.cpu(), w.cpu()).float() if gated
            else linear_ref(x.cpu().float(), w.cpu().float(), None if b is None else b.cpu().float()))
    assert got.shape == (1, 1, n // 2 if gated else n) and got.dtype == dtype and not got.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7 if not gated else 2 ** -5 if device == "cpu" else 2 ** -6
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * k ** 0.5)


def check_norm(device, n, k, with_add, gated, bias=False):
    """The RMSNorm folded in, against the reference in fp32 on the same (x + add, rounded) row: the kernel does
    not round the normed row, so only the output's rounding and the sums' order are left. x + add itself is
    bit-equal on the GPU (one rounding of an exact sum)."""
    from clo.kernels.gemv import gemv_triton

    x, w = randn(1, 1, k, seed=1, device=device) * 3, randn(n, k, seed=2, device=device)
    add = randn(1, 1, k, seed=3, device=device) if with_add else None
    g, b = randn(k, seed=4, device=device), randn(n, seed=5, device=device) if bias else None
    s = torch.empty_like(x) if with_add else x
    got = gemv_triton(x, w, b, gated, norm=(add, g, 1e-5, s)).cpu()
    want_s = x.cpu() + add.cpu() if with_add else x.cpu()
    if device == "cuda":
        assert torch.equal(s.cpu(), want_s)
    torch.testing.assert_close(s.cpu(), want_s, rtol=2 ** -7, atol=0)
    want = norm_linear_ref(want_s.float(), None, g.cpu().float(), 1e-5, w.cpu().float(),
                           None if b is None else b.cpu().float(), gated)[0]
    tol = 2 ** -6 if gated else 2 ** -7
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * k ** 0.5 * (3 if gated else 1))
    return got


def check_rope(device, heads, total, d, k, position, block_n):
    """The norm and RoPE folded in (the decoder's q/k/v), against the reference in fp32: the first `heads` of
    `total` heads rotated, the rest (v) untouched."""
    from clo.kernels.gemv import gemv_triton

    x, w = randn(1, 1, k, seed=1, device=device), randn(total * d, k, seed=2, device=device)
    g = randn(k, seed=4, device=device)
    inv = 1.0 / 500000.0 ** (torch.arange(0, d, 2).float() / d)
    pos = torch.tensor([position])
    got = gemv_triton(x, w, norm=(None, g, 1e-5, x), rope=(pos.to(device), inv.to(device), heads),
                      params=(block_n, 256, 4)).cpu()
    plain = norm_linear_ref(x.cpu().float(), None, g.cpu().float(), 1e-5, w.cpu().float())[0]
    want = norm_linear_ref(x.cpu().float(), None, g.cpu().float(), 1e-5, w.cpu().float(), rope=(pos, inv, heads))[0]
    assert not torch.equal(want[..., : heads * d], plain[..., : heads * d])  # the rotation does something here
    tol = 2 ** -6
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * k ** 0.5)


@interpreter
@pytest.mark.parametrize("with_add,gated", [(True, False), (False, True)])
def test_norm_gemv_interpreted(with_add, gated):
    check_norm("cpu", 20, 600, with_add, gated)


@interpreter
@pytest.mark.parametrize("block_n", [2, 8])
def test_rope_gemv_interpreted(block_n):
    check_rope("cpu", 3, 5, 16, 256, 70_000, block_n)


@gpu
@pytest.mark.parametrize("heads,total,position,block_n", [(40, 48, 3, 2), (40, 48, 131_071, 2), (32, 32, 1_000_000, 8)])
def test_rope_gemv_triton_matches_ref(heads, total, position, block_n):
    check_rope("cuda", heads, total, 128, 4096, position, block_n)


def test_rope_needs_whole_heads():
    from clo.kernels.gemv import gemv_triton
    with pytest.raises(ValueError, match="RoPE"):
        gemv_triton(randn(1, 1, 32), randn(24, 32), rope=(torch.tensor([1]), torch.rand(8), 1))


@gpu
@pytest.mark.parametrize("n,k,with_add,gated,bias", [(6144, 4096, True, False, False), (4096, 4096, False, False, False),
                                                    (28672, 4096, True, True, False), (7168, 5120, True, False, True)])
def test_norm_gemv_triton_matches_ref(n, k, with_add, gated, bias):
    got = check_norm("cuda", n, k, with_add, gated, bias)
    if gated:  # a product of two roundings: its error is relative to the factors', not to the product
        return
    # and the unfused path (the normed row rounded to bf16 twice) is within a few bf16 steps of it
    x, w = randn(1, 1, k, seed=1, device="cuda") * 3, randn(n, k, seed=2, device="cuda")
    add = randn(1, 1, k, seed=3, device="cuda") if with_add else None
    b = randn(n, seed=5, device="cuda") if bias else None
    unfused = norm_linear_ref(x, add, randn(k, seed=4, device="cuda"), 1e-5, w, b)[0]
    torch.testing.assert_close(got.float(), unfused.float().cpu(), rtol=2 ** -5, atol=2 ** -5 * k ** 0.5)


@gpu
def test_norm_linear_dispatch():
    x, add = randn(1, 1, 256, seed=0, device="cuda"), randn(1, 1, 256, seed=1, device="cuda")
    g, w = randn(256, seed=2, device="cuda"), randn(64, 256, seed=3, device="cuda")
    y, s = norm_linear(x, add, g, 1e-5, w)
    assert torch.equal(s, x + add) and s.data_ptr() not in (x.data_ptr(), add.data_ptr())
    torch.testing.assert_close(y, norm_linear_ref(x, add, g, 1e-5, w)[0], rtol=2 ** -5, atol=0.2)
    y2 = norm_linear(torch.cat([x, x]), torch.cat([add, add]), g, 1e-5, w)[0]  # two rows: the reference
    assert torch.equal(y2, norm_linear_ref(torch.cat([x, x]), torch.cat([add, add]), g, 1e-5, w)[0])


@interpreter
@pytest.mark.parametrize("n,k,bias,gated", [(24, 1024, False, False), (13, 700, True, False), (40, 600, False, True)])
def test_gemv_interpreted(n, k, bias, gated):  # 13 x 700: masked rows and a masked last step along K
    check("cpu", n, k, torch.bfloat16, bias, gated)


@gpu
@pytest.mark.parametrize("n,k,dtype,bias,gated", [
    (6144, 4096, torch.bfloat16, False, False),   # Llama-3-8B q/k/v
    (4096, 14336, torch.bfloat16, False, False),  # down
    (28672, 4096, torch.bfloat16, False, True),   # gate/up with SiLU-multiply
    (7168, 5120, torch.bfloat16, True, False),    # Qwen2.5-14B q/k/v, with bias
    (1000, 576, torch.float32, True, False),      # masked rows, fp32
    (30, 1000, torch.bfloat16, False, True)])     # masked everything, gated
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
    torch.testing.assert_close(linear(x[:1], w), linear_ref(x[:1], w), rtol=2 ** -7, atol=0.2)


def test_dispatch_on_cpu_is_the_reference():
    x, w, b = randn(3, 1, 32), randn(8, 32, seed=1), randn(8, seed=2)
    assert torch.equal(linear(x, w, b), linear_ref(x, w, b))
    assert torch.equal(linear_silu_mul(x[:1], w), linear_silu_mul_ref(x[:1], w))
    g, add = randn(32, seed=3), randn(1, 1, 32, seed=4)
    y, s = norm_linear(x[:1], add, g, 1e-5, w, b)
    want_y, want_s = norm_linear_ref(x[:1], add, g, 1e-5, w, b)
    assert torch.equal(y, want_y) and torch.equal(s, want_s) and torch.equal(s, x[:1] + add)


def test_shape_mismatch_is_a_clear_error():
    from clo.kernels.gemv import gemv_triton
    with pytest.raises(ValueError, match="gemv"):
        gemv_triton(randn(1, 1, 32), randn(8, 16))
