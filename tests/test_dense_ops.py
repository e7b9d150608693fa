"""The decoder's elementwise kernels (RMSNorm with its residual addition, decode RoPE, SiLU-multiply) against their
torch references, in the Triton interpreter (TRITON_INTERPRET=1) and on the GPU; the references against the
plain formulas everywhere."""

import os

import pytest
import torch
import torch.nn.functional as F

from kvoffload.kernels.dense_ops import apply_rotary, cos_sin, rms_norm_ref, rope_ref, silu_mul_ref
from tests.reference import randn
from tests.tiny_models import tiny_config

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpreter = pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1 to run the kernels on the CPU")
gpu = pytest.mark.gpu


# ---- the references ----------------------------------------------------------------------------------------
def test_rms_norm_ref_normalises_the_sum():
    x, add, w = (
        randn(3, 64, seed=0, dtype=torch.float64),
        randn(3, 64, seed=1, dtype=torch.float64),
        randn(64, seed=2, dtype=torch.float64),
    )
    y, s = rms_norm_ref(x, w, 1e-6, add)
    assert torch.equal(s, x + add)
    torch.testing.assert_close(y / w, s / s.pow(2).mean(-1, keepdim=True).sqrt(), rtol=1e-6, atol=1e-9)


def test_rope_ref_rotates_the_first_heads_only():
    x = randn(2, 5, 8, dtype=torch.float32)
    inv = torch.rand(4)
    got = rope_ref(x.clone(), 3, torch.tensor([7]), inv)
    cos, sin = cos_sin(torch.tensor([7]), inv, x.dtype)
    torch.testing.assert_close(got[:, :3], apply_rotary(x[:, :3], cos, sin))
    assert torch.equal(got[:, 3:], x[:, 3:])
    torch.testing.assert_close(got.norm(dim=-1), x.norm(dim=-1))  # a rotation


def test_silu_mul_ref_is_gated():
    gu = randn(2, 3, 10, dtype=torch.float32)
    torch.testing.assert_close(silu_mul_ref(gu), F.silu(gu[..., :5]) * gu[..., 5:])


# ---- the kernels against the references (shared by the interpreter and the GPU tests) ----------------------
def close(got, want, device, atol=None):
    """The GPU rounds to bf16 to nearest even, as torch does; the interpreter truncates: one bf16 step apart.
    The kernels round once where the torch code rounds each product: rope's sums may differ by a step of their
    terms (~1e-2 for unit inputs)."""
    if device == "cpu":
        torch.testing.assert_close(got, want, atol=2**-5, rtol=2**-6)
    else:
        torch.testing.assert_close(got, want, atol=atol, rtol=None if atol is None else 1.6e-2)


def check_rms_norm(device, rows, n, dtype, with_add):
    from kvoffload.kernels.dense_ops import rms_norm_triton

    x, w = randn(rows, 1, n, seed=0, dtype=dtype, device=device), randn(n, seed=1, dtype=dtype, device=device)
    add = randn(rows, 1, n, seed=2, dtype=dtype, device=device) if with_add else None
    y, s = rms_norm_triton(x, w, 1e-5, add)
    want_y, want_s = rms_norm_ref(x.cpu(), w.cpu(), 1e-5, None if add is None else add.cpu())
    if device == "cuda":
        assert torch.equal(s.cpu(), want_s)  # one rounding of an exact sum: bit-equal
    close(s.cpu(), want_s, device)
    assert y.dtype == want_y.dtype and not y.isnan().any()
    close(y.cpu(), want_y, device)
    # with a second weight (rms_norm_pair): the same y and sum, and the second norm of the sum
    w2 = randn(n, seed=3, dtype=dtype, device=device)
    y_a, s_a, y2 = rms_norm_triton(x, w, 1e-5, add, w2)
    assert torch.equal(y_a, y) and torch.equal(s_a, s)
    close(y2.cpu(), rms_norm_ref(want_s, w2.cpu(), 1e-5)[0], device)


def check_rope(device, b, total, heads, d, dtype, position):
    from kvoffload.kernels.dense_ops import rope_triton
    from kvoffload.model.config import ModelConfig
    from kvoffload.model.rope import inverse_frequencies

    cfg = ModelConfig(
        "t",
        "llama",
        64,
        128,
        1,
        4,
        1,
        d,
        10,
        500000.0,
        1e-5,
        8192,
        rope_scaling={
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    inv = inverse_frequencies(cfg)
    x = randn(b, total, d, dtype=dtype, device=device)
    pos = torch.tensor([position])
    got = rope_triton(x.clone(), heads, pos.to(device), inv.to(device)).cpu()
    want = rope_ref(x.cpu().clone(), heads, pos, inv)
    assert torch.equal(got[:, heads:], x.cpu()[:, heads:])  # the rest untouched
    close(got, want, device, atol=1e-2 if dtype == torch.bfloat16 else None)


def check_silu_mul(device, rows, inter, dtype):
    from kvoffload.kernels.dense_ops import silu_mul_triton

    gu = randn(rows, 1, 2 * inter, dtype=dtype, device=device) * 3
    got = silu_mul_triton(gu).cpu()
    assert got.shape == (rows, 1, inter)
    close(got, silu_mul_ref(gu.cpu()), device)


@interpreter
@pytest.mark.parametrize("n,with_add", [(64, True), (96, False)])  # 96: a masked block
def test_rms_norm_interpreted(n, with_add):
    check_rms_norm("cpu", 3, n, torch.bfloat16, with_add)


@interpreter
@pytest.mark.parametrize("position", [5, 131_071])
def test_rope_interpreted(position):
    check_rope("cpu", 2, 7, 5, 16, torch.bfloat16, position)


@interpreter
def test_silu_mul_interpreted():
    check_silu_mul("cpu", 2, 1500, torch.bfloat16)  # two blocks, the second masked


@gpu
@pytest.mark.parametrize(
    "n,dtype,with_add",
    [
        (4096, torch.bfloat16, True),
        (4096, torch.bfloat16, False),
        (5120, torch.float32, True),
        (576, torch.bfloat16, True),
    ],
)
def test_rms_norm_triton_matches_ref(n, dtype, with_add):
    check_rms_norm("cuda", 5, n, dtype, with_add)


@gpu
@pytest.mark.parametrize("d,position", [(128, 3), (128, 524_287), (64, 1_000_000)])
def test_rope_triton_matches_ref(d, position):
    check_rope("cuda", 2, 48, 40, d, torch.bfloat16, position)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_triton_matches_ref(dtype):
    check_silu_mul("cuda", 3, 14336, dtype)


def separate_inputs(layer, nxt, x, add, position, inv_freq):
    """Layer.decode_inputs's results made one kernel (or torch op) at a time: the layer's norm, q/k/v and RoPE,
    then the next layer's norm of the same sum, its q rows and RoPE (the speculative query, docs/systems.md)."""
    from kvoffload.kernels.dense_ops import rms_norm, rope
    from kvoffload.kernels.gemv import linear

    h, x = layer.input_layernorm.add_and_norm(x, add)
    q, k, v = layer.self_attn.decode_qkv(h, position, inv_freq)
    a = nxt.self_attn
    q_spec = linear(rms_norm(x, nxt.input_layernorm.weight, nxt.input_layernorm.eps)[0], *a.query_weights())
    return x, q, k, v, rope(q_spec.view(x.shape[0], a.h, a.d), a.h, position, inv_freq)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_decode_inputs_pairs_the_speculative_query_exactly(device, family):
    """Both norms in one kernel, both projections in one GEMV, one RoPE: the same values as made apart (bit for
    bit: every element is computed by the same arithmetic), with and without the previous MLP's output to add."""
    from kvoffload.model.rope import inverse_frequencies
    from kvoffload.model.weights import synthetic_decoder

    cfg = tiny_config(family=family, hidden_size=256, intermediate_size=512, head_dim=64, max_position_embeddings=4096)
    model = synthetic_decoder(cfg, 0, torch.device(device), torch.bfloat16)
    layer, nxt = model.model.layers
    position, inv = torch.tensor([1234], device=device), inverse_frequencies(cfg).to(device)
    x, add = randn(1, 1, 256, seed=1, device=device), randn(1, 1, 256, seed=2, device=device)
    for a in (add, None):
        got = layer.decode_inputs(x, a, position, inv, nxt)
        want = separate_inputs(layer, nxt, x, a, position, inv)
        for g, w in zip(got, want):
            assert g.shape == w.shape and torch.equal(g, w)
