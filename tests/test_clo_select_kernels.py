"""CLO's selection kernels against their references: the query encoding, the hash scores (the reference, the
compiled CPU distances, the Triton kernel with its pooling and the radix select's first pass counted beside it)
and the radix top-k (bf16 scores too).

The references run everywhere; the Triton kernels run on the GPU (`-m gpu`) and in the Triton interpreter:
TRITON_INTERPRET=1 python -m pytest tests/test_clo_select_kernels.py, or `bash scripts/interpret_kernels.sh`
(tests/test_clo_kernels.py says which triton and numpy the interpreter needs).
"""

import pytest
import torch

from kvoffload.kernels.hash_score import block_max, hash_scores_ref, pack_signs
from kvoffload.kernels.radix_keys import count_first_pass_ref, radix_work
from kvoffload.offload.retrieval import HashRetriever
from tests.clo_kernel_cases import hash_case, interpreter


def test_hash_scores_ref_is_signed_dot_product():
    """(G - 2 hamming / rbit) |k| summed over the group = sum_g sign(q_g) . sign(k) / rbit * |k|."""
    gen = torch.Generator().manual_seed(0)
    xq, xk = torch.randn(2, 3, 4, 64, generator=gen), torch.randn(2, 3, 100, 64, generator=gen)
    norms = torch.rand(2, 3, 100, generator=gen)
    want = torch.einsum("bhgr,bhtr->bht", xq.sign(), xk.sign()) / 64 * norms
    got = hash_scores_ref(pack_signs(xk), norms, pack_signs(xq), 64)
    torch.testing.assert_close(got, want)


def test_hash_scores_ref_matches_retriever():
    b, hkv, g_, d, t = 2, 4, 3, 32, 70
    hr = HashRetriever(1, hkv, d, torch.device("cpu"), rbit=128, seed=1)
    gen = torch.Generator().manual_seed(1)
    hr.index(0, torch.randn(b, hkv, t, d, generator=gen))
    q, heads = torch.randn(b, hkv * g_, d, generator=gen), torch.tensor([3, 0])
    qc = hr.encode(0, q.view(b, hkv, g_, d))[:, heads]
    want = hr.scores(0, q, heads)
    assert torch.equal(hash_scores_ref(hr.codes[0], hr.norms[0], qc, 128, heads), want)
    assert torch.equal(hash_scores_ref(hr.codes[0][:, heads], hr.norms[0][:, heads], qc, 128), want)


@pytest.mark.parametrize("rbit", [64, 128, 256, 512])
@pytest.mark.parametrize("use_heads", [False, True])
@pytest.mark.parametrize("b,t,g_", [(1, 1, 1), (2, 300, 3), (3, 1027, 4)])
def test_hash_scores_cpu_equals_ref(rbit, use_heads, b, t, g_):
    """The compiled CPU distances give the reference's scores bit for bit, through the dispatcher too."""
    from kvoffload.kernels.hash_score import hash_scores
    from kvoffload.kernels.hash_score_cpu import hash_scores_cpu, runs

    codes, norms, qcodes, heads = hash_case(b, 5, 3 if use_heads else 5, t, g_, rbit, "cpu", seed=rbit + t)
    heads = heads if use_heads else None
    want = hash_scores_ref(codes, norms, qcodes, rbit, heads)
    assert runs(codes, rbit)
    assert torch.equal(hash_scores_cpu(codes, norms, qcodes, rbit, heads), want)
    assert torch.equal(hash_scores(codes, norms, qcodes, rbit, heads), want)
    # codes and query codes as the retriever hands them: strided views
    wide = torch.cat([codes, codes], dim=-1)[..., : rbit // 8]
    q_strided = qcodes.transpose(0, 1).contiguous().transpose(0, 1)
    assert torch.equal(hash_scores_cpu(wide, norms, q_strided, rbit, heads), want)


def test_hash_scores_cpu_extremes():
    """All bits equal and all bits different: distances 0 and rbit per query head (every word's popcount exact)."""
    from kvoffload.kernels.hash_score_cpu import hash_scores_cpu

    codes = torch.full((1, 2, 4, 32), 0xFF, dtype=torch.uint8)
    codes[:, 1] = 0
    norms = torch.ones(1, 2, 4)
    q = torch.full((1, 2, 3, 32), 0xFF, dtype=torch.uint8)
    got = hash_scores_cpu(codes, norms, q, 256)
    assert torch.equal(got[0, 0], torch.full((4,), 3.0)) and torch.equal(got[0, 1], torch.full((4,), -3.0))


def check_hash_scores(device, b, hk, h, t, g_, rbit, use_heads, block_t=256):
    from kvoffload.kernels.hash_score import hash_scores_triton

    codes, norms, qcodes, heads = hash_case(b, hk, h if use_heads else hk, t, g_, rbit, device)
    heads = heads if use_heads else None
    got = hash_scores_triton(codes, norms, qcodes, rbit, heads, block_t=block_t).cpu()
    want = hash_scores_ref(codes.cpu(), norms.cpu(), qcodes.cpu(), rbit, None if heads is None else heads.cpu())
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)  # integer hamming: fp32 rounding at most
    # with CLO's lookup result: the first nc heads' rows only where they missed, the rest always
    nc = got.shape[1] - 1
    miss = torch.rand(b, nc, generator=torch.Generator().manual_seed(7)) < 0.5
    miss[0, 0], miss[-1, -1] = True, False
    need = torch.cat([miss, torch.ones(b, 1, dtype=torch.bool)], 1)
    hist = radix_work(b * got.shape[1], device)
    got = hash_scores_triton(codes, norms, qcodes, rbit, heads, block_t=block_t, miss=miss.to(device), hist=hist).cpu()
    torch.testing.assert_close(got[need], want[need], rtol=1e-6, atol=1e-5)
    # the radix select's first pass, counted beside the scores: exactly torch's count of the scored rows
    counted = radix_work(b * got.shape[1], "cpu")
    count_first_pass_ref(got, counted)
    rows = need.flatten()
    first = lambda w: w[: rows.numel() * 256].view(-1, 256)
    assert torch.equal(first(hist.cpu())[rows], first(counted)[rows]) and first(hist.cpu())[rows].sum() > 0
    assert not hist.cpu()[rows.numel() * 256 :].any()  # the later passes' histograms and the counters untouched
    # pooled: each block of 8 tokens by its best (a partial last block by its real tokens), counted as such
    hist = radix_work(b * got.shape[1], device)
    pooled = hash_scores_triton(
        codes, norms, qcodes, rbit, heads, block_t=block_t, miss=miss.to(device), hist=hist, pool=8
    ).cpu()
    torch.testing.assert_close(pooled[need], block_max(want, 8)[need], rtol=1e-6, atol=1e-5)
    counted = radix_work(b * got.shape[1], "cpu")
    count_first_pass_ref(pooled, counted)
    assert torch.equal(first(hist.cpu())[rows], first(counted)[rows])


def check_radix_topk(device, r, t, k, kind, block, ordered=False):
    from kvoffload.kernels.radix_topk import radix_topk, topk_ref

    gen = torch.Generator().manual_seed(r * t + k)
    scores = {
        "randn": lambda: torch.randn(r, t, generator=gen),
        "ties": lambda: torch.randint(0, 7, (r, t), generator=gen).float(),  # the k-th value is shared
        "negative": lambda: -torch.rand(r, t, generator=gen) * 1e-3,
        # consecutive floats above 1: the keys differ in their low bits only, so the last pass decides
        "ulps": lambda: 1.0 + torch.stack([torch.randperm(t, generator=gen) for _ in range(r)]).float() * 2**-23,
    }[kind]()
    launch = {"block": block} if block else {}
    # rows as one sequence of r heads; with `miss`, the first r - 1 only where they missed (CLO's hits are not
    # selected: their rows stay as they were)
    miss = torch.arange(r - 1)[None] % 2 == 0
    counted = radix_work(r, device)  # the first pass counted before (as hash_scores(hist=) does), three left
    count_first_pass_ref(scores.to(device), counted)
    for m, work in ((None, None), (miss, None), (None, counted.clone()), (miss, counted)):
        got = (
            radix_topk(
                scores.to(device),
                k,
                offset=5,
                miss=None if m is None else m.to(device),
                work=work,
                ordered=ordered,
                **launch,
            ).cpu()
            - 5
        )
        assert got.shape == (r, k)
        for row, idx in enumerate(got):
            if m is not None and row < r - 1 and not m[0, row]:
                continue
            assert idx.unique().numel() == k and 0 <= idx.min() and idx.max() < t  # k distinct positions
            assert not ordered or bool((idx[1:] > idx[:-1]).all())  # ascending, as the select wrote them
            want = scores[row, topk_ref(scores[row], k)]
            assert torch.equal(scores[row, idx].sort().values, want.sort().values)  # the k largest values


@interpreter
@pytest.mark.parametrize(
    "r,t,k,kind",
    [
        (3, 1000, 100, "randn"),
        (2, 777, 777, "randn"),
        (2, 500, 1, "randn"),
        (4, 1000, 300, "ties"),
        (2, 600, 50, "negative"),
        (2, 900, 333, "ulps"),
    ],
)
@pytest.mark.parametrize("ordered", [False, True])
def test_radix_topk_interpreted(r, t, k, kind, ordered):
    pytest.importorskip("triton")
    check_radix_topk("cpu", r, t, k, kind, block=128, ordered=ordered)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "r,t,k,kind",
    [
        (8, 131072, 13028, "randn"),
        (6, 131072, 13028, "ties"),
        (2, 5000, 5000, "negative"),
        (3, 70000, 1, "randn"),
        (2, 131072, 13028, "ulps"),
    ],
)
@pytest.mark.parametrize("block", [None, 4096])  # None: radix_topk's default (2048 keys, 4 warps)
@pytest.mark.parametrize("ordered", [False, True])
def test_radix_topk_triton_matches_ref(r, t, k, kind, block, ordered):
    pytest.importorskip("triton")
    check_radix_topk("cuda", r, t, k, kind, block=block, ordered=ordered)


def check_encode_query(device, b, hkv, g_, d, rbit, dtype, chunk=None):
    """The kernel's codes are HashRetriever.encode's, except for signs of projections within float rounding
    of zero (the kernel sums in another order)."""
    from kvoffload.kernels.hash_score import encode_query_triton

    hr = HashRetriever(2, hkv, d, torch.device(device), rbit=rbit, seed=3)
    gen = torch.Generator().manual_seed(b * hkv + g_)
    q = torch.randn(b, hkv * g_, d, generator=gen).to(dtype)
    heads = torch.randperm(hkv, generator=gen)[: max(1, hkv - 1)]
    got = encode_query_triton(q.to(device), hr.proj[1], heads.to(device), g_, chunk).cpu()
    want = hr.encode(1, q.to(device).view(b, hkv, g_, d))[:, heads.to(device)].cpu()
    assert got.shape == want.shape == (b, len(heads), g_, rbit // 8)
    proj = torch.einsum("bkgd,kdr->bkgr", q.double().view(b, hkv, g_, d), hr.proj[1].cpu().double())[:, heads]
    clear = proj.abs() > 1e-4  # bits whose sign no summation order can flip
    bits = lambda codes: ((codes[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1).flatten(-2).bool()
    assert torch.equal(bits(got)[clear], bits(want)[clear]) and clear.float().mean() > 0.99


@interpreter
@pytest.mark.parametrize("g_,d,rbit,chunk", [(4, 16, 64, None), (3, 32, 96, None), (4, 32, 64, 8)])
def test_encode_query_interpreted(g_, d, rbit, chunk):
    """chunk 8 < head_dim: the loop over head_dim in steps (the default takes it in one step)."""
    pytest.importorskip("triton")
    check_encode_query("cpu", 2, 3, g_, d, rbit, torch.bfloat16, chunk)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "g_,d,rbit,dtype", [(4, 128, 256, torch.bfloat16), (5, 64, 128, torch.float16), (4, 128, 256, torch.float32)]
)
def test_encode_query_triton_matches_ref(g_, d, rbit, dtype):
    pytest.importorskip("triton")
    check_encode_query("cuda", 2, 8, g_, d, rbit, dtype)


@interpreter
@pytest.mark.parametrize("rbit,use_heads", [(256, True), (128, False), (96, True)])
def test_hash_scores_interpreted(rbit, use_heads):
    pytest.importorskip("triton")
    check_hash_scores("cpu", 2, 4, 3, 300, 3, rbit, use_heads, block_t=64)


@pytest.mark.gpu
@pytest.mark.parametrize("rbit,use_heads", [(256, True), (256, False), (128, True)])
@pytest.mark.parametrize("g_", [4, 5])
def test_hash_scores_triton_matches_ref(rbit, use_heads, g_):
    pytest.importorskip("triton")
    check_hash_scores("cuda", 2, 8, 6, 10_000, g_, rbit, use_heads)


@pytest.mark.gpu
def test_radix_selects_bf16_scores_ascending():
    """InfiniGen-style's partial scores are bf16: with topk=radix they are widened and selected by the radix
    kernels (not torch.topk), ascending as its gather wants them; the values are torch.topk's (bf16 ties many)."""
    from kvoffload.kernels.radix_topk import topk_indices

    scores = torch.randn(8, 131072, device="cuda").to(torch.bfloat16)
    got = topk_indices(scores, 13108, ordered=True)
    assert bool((got[:, 1:] > got[:, :-1]).all())
    want = scores.topk(13108, dim=-1).values.sort(-1).values
    assert torch.equal(scores.gather(1, got).sort(-1).values, want)


def test_block_max_scores_a_partial_block_by_its_real_tokens():
    scores = torch.tensor([[1.0, 5.0, 2.0, -1.0, 3.0, -4.0, 0.5]])
    assert block_max(scores, 3).tolist() == [[5.0, 3.0, 0.5]] and block_max(scores, 1) is scores


@pytest.mark.gpu
@pytest.mark.parametrize("pool", [8, 12])  # 12 does not divide the kernel's tile: pooled in torch
def test_hash_scores_pooled_on_the_gpu_equal_block_max(pool):
    from kvoffload.kernels.hash_score import hash_scores

    codes, norms, qcodes, heads = hash_case(1, 8, 8, 10_003, 4, 256, "cuda")
    want = block_max(hash_scores(codes, norms, qcodes, 256, heads), pool)
    work = radix_work(8, torch.device("cuda"))
    got = hash_scores(codes, norms, qcodes, 256, heads, hist=work, pool=pool)
    assert torch.equal(got, want)
    counted = radix_work(8, torch.device("cpu"))
    count_first_pass_ref(want.cpu(), counted)
    assert torch.equal(work.cpu(), counted)
