"""FP8 host rows (docs/fp8.md): the packed format's round trip, and decode attention over FP8 rows against its
reference (the rows dequantised, then attended). The Triton kernel runs in Triton's interpreter
(`bash scripts/interpret_kernels.sh -k fp8`) and on CUDA (the gpu-marked tests)."""

import os

import pytest
import torch

from kvoffload.kernels import decode_attention_fp8 as fp8_kernel
from kvoffload.kernels.decode_attention import attend_packed, decode_attention_ref, hybrid_attention, merge_attention
from kvoffload.kernels.fp8_rows import FP8_MAX, dequantize_rows, fp8_halves, quantize_rows

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def test_round_trip_error_is_within_e4m3_rounding():
    """Each value comes back within half an e4m3 step of its scaled self: 2^-4 relative for normals, 2^-10 of the
    scale for subnormals; a zero half comes back zero, and the largest magnitude maps to 448."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 50, 2, 64, generator=g) * torch.logspace(-3, 2, 50)[None, None, :, None, None]
    x[0, 0, 0] = 0.0
    packed = quantize_rows(x)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 4, 50, 2, 66)
    values, scales = fp8_halves(packed)
    assert values.float().abs().amax(-1).max() <= FP8_MAX
    back = dequantize_rows(packed, torch.float32)
    bound = x.abs() * 2**-4 + scales.float()[..., None] * 2**-10
    assert ((back - x).abs() <= bound * 1.001).all()
    assert (back[0, 0, 0] == 0).all()


def test_halves_are_views_of_the_packed_rows():
    packed = quantize_rows(torch.randn(2, 5, 2, 8))
    values, scales = fp8_halves(packed)
    assert values.data_ptr() == packed.data_ptr() and scales.shape == (2, 5, 2)
    assert scales.data_ptr() == packed.data_ptr() + 8


def parts(b, hkv, g, d, n1, n2, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    q = r(b, hkv * g, d)
    first = (r(b, n1, hkv, d), r(b, n1, hkv, d), torch.full((b,), n1, device=device))
    rows = quantize_rows(torch.randn(b, hkv, n2, 2, d, generator=gen).to(device) * 3)  # [B, Hkv, n2, 2, D + 2]
    return q, first, rows


def second_of(rows, d):
    k8, v8 = (rows[:, :, :, j, :d].transpose(1, 2) for j in (0, 1))
    scales = tuple(rows[:, :, :, j, d:].view(torch.float16)[..., 0].transpose(1, 2) for j in (0, 1))
    lengths = torch.full((rows.shape[0],), rows.shape[2], device=rows.device)
    return (k8, v8, lengths), scales


def reference(q, first, rows, keep=None, dtype=None):
    """The specification: the rows dequantised into q's dtype, attention over both buffers merged by log-sum-exp.
    dtype: compute in it instead (fp32 for a bf16 kernel, which accumulates in fp32: a bf16 reference rounds its
    probabilities and would differ from the kernel by its own rounding, not the kernel's)."""
    if dtype is not None:
        return reference(q.to(dtype), tuple(t.to(dtype) if t.is_floating_point() else t for t in first), rows, keep)
    deq = dequantize_rows(rows, q.dtype)
    k2, v2 = deq[:, :, :, 0].transpose(1, 2), deq[:, :, :, 1].transpose(1, 2)
    lengths = torch.full((rows.shape[0],), rows.shape[2], device=rows.device)
    keep2 = None if keep is None else keep.transpose(1, 2)
    return merge_attention(
        [decode_attention_ref(q, *first, return_lse=True), decode_attention_ref(q, k2, v2, lengths, True, keep2)]
    )


def test_hybrid_attention_with_fp8_slots_is_its_reference_on_the_cpu():
    q, first, rows = parts(2, 3, 3, 64, 20, 37)
    second, scales = second_of(rows, 64)
    out = hybrid_attention(q, first, second, second_scales=scales)
    torch.testing.assert_close(out, reference(q, first, rows), atol=1e-5, rtol=1e-5)


def test_attend_packed_masks_the_rows_that_are_no_tokens():
    q, first, rows = parts(2, 3, 3, 64, 20, 16)
    keep = torch.ones(2, 3, 16, dtype=torch.bool)
    keep[:, :, 12:] = False
    out = attend_packed(q, first, rows, keep)
    torch.testing.assert_close(out, reference(q, first, rows, keep), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, attend_packed(q, first, rows))  # the masked rows would have had weight


def kernel_cases(device, dtype, tol):
    """The Triton split over FP8 rows against the reference: plain, several query heads a KV head, a permuted head
    order, persistent (indexed) heads beside the FP8 ones, and a keep mask; `tol` the comparison's."""
    from kvoffload.kernels.decode_attention import SplitAttention, decode_attention_triton

    q, first, rows = parts(2, 4, 4, 64, 70, 150, dtype, device)
    second, scales = second_of(rows, 64)
    out = decode_attention_triton(q, *first, second=second, second_scales=(*scales, None))
    torch.testing.assert_close(out, reference(q, first, rows, dtype=torch.float32).to(dtype), **tol)
    keep = torch.rand(2, 4, 150, device=device) > 0.3
    out = decode_attention_triton(q, *first, second=second, second_scales=(*scales, keep.transpose(1, 2)))
    torch.testing.assert_close(out, reference(q, first, rows, keep, dtype=torch.float32).to(dtype), **tol)
    # two FP8 heads, two indexed (persistent) heads in model dtype, a permuted head order, in two launches
    nc = 2
    sub = rows[:, :nc]
    second, scales = second_of(sub, 64)
    gen = torch.Generator().manual_seed(1)
    pk, pv = (torch.randn(2, 90, 2, 64, generator=gen).to(device=device, dtype=dtype) for _ in "kv")
    idx = torch.randint(0, 90, (2, 2, 150), generator=gen).to(device)
    q_heads = torch.tensor([2, 0, 3, 1], device=device)
    split = SplitAttention(q, *first, second, indexed_heads=2, q_heads=q_heads, second_scales=(*scales, None))
    split.split(0, nc)
    split.split(nc, 4, (pk, pv, idx))
    out = split.merge()[0]
    cpu = lambda t: t.cpu().float()  # noqa: E731  (the reference: plain torch on CPU tensors)
    deq = dequantize_rows(sub.cpu(), torch.float32)
    want = hybrid_attention(
        cpu(q),
        tuple(cpu(t) for t in first),
        (deq[:, :, :, 0].transpose(1, 2), deq[:, :, :, 1].transpose(1, 2), second[2].cpu()),
        (cpu(pk), cpu(pv), idx.cpu()),
        q_heads=q_heads.cpu(),
    ).to(device=device, dtype=dtype)
    torch.testing.assert_close(out, want, **tol)


@pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1 to run the kernel on the CPU")
def test_fp8_split_kernel_interpreted():
    """Triton's interpreter has no float8 loads: the kernel reads the bytes and decodes e4m3 with integer ops there
    (as on a GPU below compute capability 8.9), which this runs."""
    kernel_cases("cpu", torch.float32, {"atol": 2e-4, "rtol": 2e-4})


@pytest.mark.gpu
@pytest.mark.parametrize("native", [True, False])
def test_fp8_split_kernel_on_cuda(native, monkeypatch):
    """bf16 queries and window, FP8 rows decoded natively (compute capability >= 8.9) or by integer ops."""
    if native and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("native e4m3 needs compute capability 8.9")
    monkeypatch.setattr(fp8_kernel, "native_fp8", lambda device: native)
    kernel_cases("cuda", torch.bfloat16, {"atol": 2e-2, "rtol": 2e-2})
