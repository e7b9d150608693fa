"""Kernel references (the specification) on the CPU; the fast versions against them on the GPU."""

import os

import pytest
import torch

from kvoffload.kernels.decode_attention import decode_attention_ref, merge_attention


def explicit(q, k, v, n):
    """Attention of one sequence over its first n tokens, one head at a time: the plainest form."""
    h, d = q.shape
    hkv = k.shape[1]
    out = torch.empty(h, d)
    for i in range(h):
        kk, vv = k[:n, i // (h // hkv)].float(), v[:n, i // (h // hkv)].float()
        w = torch.softmax(kk @ q[i].float() / d**0.5, 0)
        out[i] = w @ vv
    return out


def test_decode_attention_ref_respects_lengths():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, 16, generator=g)
    k, v = torch.randn(3, 50, 2, 16, generator=g), torch.randn(3, 50, 2, 16, generator=g)
    lengths = torch.tensor([1, 17, 50])
    out = decode_attention_ref(q, k, v, lengths)
    for b in range(3):
        torch.testing.assert_close(out[b], explicit(q[b], k[b], v[b], int(lengths[b])), atol=1e-5, rtol=1e-5)


def test_merge_of_disjoint_parts_is_attention_over_their_union():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 8, 16, generator=g)
    k, v = torch.randn(2, 60, 2, 16, generator=g), torch.randn(2, 60, 2, 16, generator=g)
    whole = decode_attention_ref(q, k, v, torch.tensor([60, 60]))
    a = decode_attention_ref(q, k[:, :25], v[:, :25], torch.tensor([25, 25]), return_lse=True)
    b = decode_attention_ref(q, k[:, 25:], v[:, 25:], torch.tensor([35, 35]), return_lse=True)
    torch.testing.assert_close(merge_attention([a, b]), whole, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape", [(1, 32, 8, 128, 32768), (4, 32, 8, 128, 5000), (2, 40, 8, 128, 1000), (3, 9, 3, 64, 777)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_attention_triton_matches_ref(shape, dtype):
    from kvoffload.kernels.decode_attention import decode_attention_triton

    b, h, hkv, d, cap = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, h, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(b, cap, hkv, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, cap, hkv, d, device="cuda", dtype=dtype, generator=g)
    lengths = torch.randint(1, cap + 1, (b,), device="cuda", generator=g)
    lengths[0] = cap
    got, got_lse = decode_attention_triton(q, k, v, lengths, return_lse=True)
    want, want_lse = decode_attention_ref(q, k, v, lengths, return_lse=True)
    got, want = got.float(), want.float()
    assert not got.isnan().any()
    assert (got - want).norm() / want.norm() < 1e-2
    torch.testing.assert_close(got_lse, want_lse, atol=2e-2, rtol=1e-3)


@pytest.mark.gpu
def test_decode_attention_triton_broadcast_lengths_and_fp32():
    """A stride-0 (expanded) lengths tensor, as FullAttn passes it, and fp32 inputs."""
    from kvoffload.kernels.decode_attention import decode_attention_triton

    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(3, 8, 64, device="cuda", generator=g)
    k, v = (
        torch.randn(3, 600, 2, 64, device="cuda", generator=g),
        torch.randn(3, 600, 2, 64, device="cuda", generator=g),
    )
    lengths = torch.tensor([450], device="cuda").expand(3)
    got, want = decode_attention_triton(q, k, v, lengths), decode_attention_ref(q, k, v, lengths)
    assert (got - want).norm() / want.norm() < 1e-2  # tl.dot may use tf32 for fp32 inputs


@pytest.mark.parametrize(
    "device",
    [
        pytest.param("cuda", marks=pytest.mark.gpu),
        pytest.param(
            "cpu",
            marks=pytest.mark.skipif(
                os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 to run the kernel on the CPU"
            ),
        ),
    ],
)
def test_decode_attention_over_a_batch_spanning_2_31_elements(device):
    """Dense layers keep a batch's KV in one [B, Hkv, T, 2, D] buffer: at Llama-3's 32K and BSZ 32 it spans more
    than 2^31 elements, so the last sequences' offsets must not be computed in int32 (they wrapped negative)."""
    pytest.importorskip("triton")
    from kvoffload.kernels.decode_attention import decode_attention_ref, decode_attention_triton

    b, hkv, t, d, n = 33, 2, 2**18, 64, 70  # (b - 1) * stride_b = 32 * 2^26 = 2^31 elements
    buf = torch.empty(b, hkv, t, 2, d, dtype=torch.float16, device=device)  # 4.4 GB, only n rows written
    gen = torch.Generator().manual_seed(0)
    buf[:, :, :n] = torch.randn(b, hkv, n, 2, d, generator=gen).to(buf)
    k, v = buf[:, :, :, 0].transpose(1, 2), buf[:, :, :, 1].transpose(1, 2)
    q = torch.randn(b, hkv * 2, d, generator=gen).to(buf)
    lengths = torch.full((b,), n, device=device)
    got = decode_attention_triton(q, k, v, lengths, programs=b * hkv).float()
    want = decode_attention_ref(q, k[:, :n], v[:, :n], lengths).float()
    assert ((got - want).norm(dim=(1, 2)) / want.norm(dim=(1, 2))).max() < 1e-2


def check_hybrid_attention(
    device, b, hkv, g_, d, caps, dtype, n_indexed=0, persist_len=0, attention=None, permuted=False
):
    """hybrid_attention (or `attention`, called as it is) over two buffers laid out as CLO keeps them
    ([B, Hkv, T, 2, D], read through transposed views) equals attention over their concatenation. With
    n_indexed, the last heads' second-buffer rows are those of a third buffer (persist_len tokens) at random
    distinct indices, as CLO's persistent heads. permuted: the queries come in another head order, q_heads maps
    the buffers' heads to it (as CLO's stores)."""
    from kvoffload.kernels.decode_attention import hybrid_attention

    attention = attention or hybrid_attention
    gen = torch.Generator().manual_seed(sum(caps) + n_indexed)
    nc = hkv - n_indexed
    q = torch.randn(b, hkv * g_, d, generator=gen).to(dtype).to(device)
    bufs = [torch.randn(b, h, cap, 2, d, generator=gen).to(dtype).to(device) for h, cap in zip((hkv, nc), caps)]
    lens = [torch.randint(1, cap + 1, (b,), generator=gen).to(device) for cap in caps]
    views = [(x[:, :, :, 0].transpose(1, 2), x[:, :, :, 1].transpose(1, 2), n) for x, n in zip(bufs, lens)]
    persist = torch.randn(b, n_indexed, persist_len, 2, d, generator=gen).to(dtype).to(device)
    idx = torch.rand(b, n_indexed, persist_len, generator=gen).argsort(-1)[..., : caps[1]].to(device)
    indexed = (persist[:, :, :, 0].transpose(1, 2), persist[:, :, :, 1].transpose(1, 2), idx) if n_indexed else None
    if permuted:
        order = torch.randperm(hkv, generator=gen).to(device)
        q_model = torch.empty_like(q).view(b, hkv, g_, d)
        q_model[:, order] = q.view(b, hkv, g_, d)  # buffer head j's queries sit at head order[j] of q_model
        got = attention(q_model.view(b, hkv * g_, d), *views, indexed=indexed, q_heads=order)
        got = got.view(b, hkv, g_, d)[:, order].reshape(b, hkv * g_, d).float().cpu()
    else:
        got = attention(q, *views, indexed=indexed).float().cpu()
    picked = persist.gather(2, idx[..., None, None].expand(-1, -1, -1, 2, d))  # [B, n_indexed, caps[1], 2, D]
    rows = torch.cat([bufs[1], picked], 1).cpu()
    for i in range(b):  # the reference: one buffer holding the valid rows of both
        k = torch.cat([bufs[0][i : i + 1, :, : lens[0][i]].cpu(), rows[i : i + 1, :, : lens[1][i]]], dim=2)
        want = decode_attention_ref(
            q[i : i + 1].cpu(), k[:, :, :, 0].transpose(1, 2), k[:, :, :, 1].transpose(1, 2), torch.tensor([k.shape[2]])
        )
        assert (got[i] - want[0].float()).norm() / want.norm() < 1e-2


@pytest.mark.parametrize("n_indexed", [0, 1])
@pytest.mark.parametrize("permuted", [False, True])
def test_hybrid_attention_reference(n_indexed, permuted):
    check_hybrid_attention("cpu", 2, 3, 3, 16, (40, 300), torch.float32, n_indexed, persist_len=500, permuted=permuted)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 to run the kernel on the CPU"
)
@pytest.mark.parametrize(
    "caps, lens",
    [
        ((40, 300), ([40, 7], [300, 123])),
        # 3 + 47 splits: the merge takes them in two chunks; a sequence with no
        # rows in the first buffer
        ((150, 3000), ([0, 150], [3000, 1])),
    ],
)
def test_hybrid_attention_interpreted(caps, lens):
    pytest.importorskip("triton")
    from kvoffload.kernels import decode_attention as da

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, generator=gen)
    bufs = [torch.randn(2, 2, cap, 2, 16, generator=gen) for cap in caps]
    lens = [torch.tensor(n) for n in lens]
    views = [(x[:, :, :, 0].transpose(1, 2), x[:, :, :, 1].transpose(1, 2), n) for x, n in zip(bufs, lens)]
    got, got_lse = da.decode_attention_triton(q, *views[0], second=views[1], return_lse=True)
    parts = [da.decode_attention_ref(q, *v, return_lse=True) for v in views]
    torch.testing.assert_close(got, da.merge_attention(parts), atol=1e-4, rtol=1e-4)
    lse = torch.stack([p[1] for p in parts]).logsumexp(0)  # log-sum-exp over both buffers' scores
    torch.testing.assert_close(got_lse, lse, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 to run the kernel on the CPU"
)
@pytest.mark.parametrize("hkv, n_indexed", [(3, 1), (2, 2)])  # 2, 2: every head indexed, the slots hold none
@pytest.mark.parametrize("in_parts", [False, True])
@pytest.mark.parametrize("permuted", [False, True])
def test_hybrid_attention_indexed_interpreted(hkv, n_indexed, in_parts, permuted):
    """One split launch for every head, or (in_parts, as CLO overlaps them) one for the heads read in place and
    one for the indexed heads, then the merge; the queries in the buffers' head order or mapped (q_heads)."""
    pytest.importorskip("triton")
    from kvoffload.kernels.decode_attention import SplitAttention, decode_attention_triton

    def kernel(q, first, second, indexed, q_heads=None):
        if not in_parts:
            return decode_attention_triton(q, *first, second=second, indexed=indexed, q_heads=q_heads)
        parts = SplitAttention(q, *first, second, n_indexed, q_heads=q_heads)
        if parts.nc:
            parts.split(0, parts.nc)
        parts.split(parts.nc, hkv, indexed)
        return parts.merge()[0]

    check_hybrid_attention(
        "cpu", 2, hkv, 2, 16, (70, 130), torch.float32, n_indexed, persist_len=400, attention=kernel, permuted=permuted
    )


@pytest.mark.gpu
@pytest.mark.parametrize("caps", [(96 + 32, 13028), (80, 500), (3000, 17)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_indexed", [0, 2])
def test_hybrid_attention_triton_matches_ref(caps, dtype, n_indexed):
    check_hybrid_attention("cuda", 2, 8, 4, 128, caps, dtype, n_indexed, persist_len=20000, permuted=n_indexed > 0)


@pytest.mark.parametrize("n_indexed", [0, 1, 3])
@pytest.mark.parametrize("permuted", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hybrid_attention_cpu_equals_ref(n_indexed, permuted, dtype):
    """The CPU path (the valid rows of both buffers in one SDPA call) against the reference (masks and a merge), on
    CLO's layout: a window with room to spare, slots, persistent heads at indices of which some are none (-1)."""
    from kvoffload.kernels.decode_attention import hybrid_attention, hybrid_attention_cpu, hybrid_attention_ref

    gen = torch.Generator().manual_seed(n_indexed + 10 * permuted)
    b, hkv, g_, d, cap1, k, plen = 1, 3, 3, 16, 90, 40, 200
    q = torch.randn(b, hkv * g_, d, generator=gen).to(dtype)
    win = torch.randn(b, hkv, cap1, 2, d, generator=gen).to(dtype)
    win[:, :, 70:] = float("nan")  # rows past the length are never read
    slots = torch.randn(b, hkv - n_indexed, k, 2, d, generator=gen).to(dtype)
    persist = torch.randn(b, n_indexed, plen, 2, d, generator=gen).to(dtype)
    idx = torch.rand(b, n_indexed, plen, generator=gen).argsort(-1)[..., :k]
    idx[..., :3] = -1
    view = lambda x, n: (x[:, :, :, 0].transpose(1, 2), x[:, :, :, 1].transpose(1, 2), torch.full((b,), n))
    first, second = view(win, 70), view(slots, k)
    indexed = (persist[:, :, :, 0].transpose(1, 2), persist[:, :, :, 1].transpose(1, 2), idx) if n_indexed else None
    order = torch.randperm(hkv, generator=gen) if permuted else None
    want = hybrid_attention_ref(q, first, second, indexed, order)
    # bf16: the reference rounds each part's output to bf16 before the merge, the CPU path only the result
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 4e-3}
    torch.testing.assert_close(hybrid_attention_cpu(q, first, second, indexed, order), want, **tol)
    torch.testing.assert_close(hybrid_attention(q, first, second, indexed, order), want, **tol)


def test_decode_attention_cpu_equals_ref():
    """The CPU path of decode_attention (the first `length` rows, one SDPA call) against the reference; lengths that
    differ between sequences take the reference."""
    from kvoffload.kernels.decode_attention import decode_attention

    gen = torch.Generator().manual_seed(4)
    q, k, v = (
        torch.randn(2, 6, 32, generator=gen),
        torch.randn(2, 100, 2, 32, generator=gen),
        torch.randn(2, 100, 2, 32, generator=gen),
    )
    k[:, 80:] = float("nan")
    for lengths in (torch.tensor([80, 80]), torch.tensor([80, 17])):
        want = decode_attention_ref(q, k, v, lengths)
        torch.testing.assert_close(decode_attention(q, k, v, lengths), want, rtol=1e-5, atol=1e-6)


def test_hybrid_attention_with_an_empty_buffer():
    """A buffer with no valid rows for a sequence, or no rows at all, adds nothing (no NaN from softmax over
    nothing)."""
    from kvoffload.kernels.decode_attention import hybrid_attention

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 16, generator=gen)
    k, v = torch.randn(2, 30, 2, 16, generator=gen), torch.randn(2, 30, 2, 16, generator=gen)
    full = (k, v, torch.tensor([30, 12]))
    want = decode_attention_ref(q, *full)
    none_for_one = (k[:, :5], v[:, :5], torch.tensor([0, 5]))  # sequence 0 has no rows here
    got = hybrid_attention(q, full, none_for_one)
    assert not got.isnan().any()
    torch.testing.assert_close(got[0], want[0])
    no_rows = (k[:, :0], v[:, :0], torch.tensor([0, 0]))
    torch.testing.assert_close(hybrid_attention(q, no_rows, full), want)
