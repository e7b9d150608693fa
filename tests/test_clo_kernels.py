"""CLO's kernels (UVA gather, hash scores, radix top-k, fused cache lookup) against their references.

The references run everywhere; the Triton kernels run on the GPU (`-m gpu`) and, on a CPU machine with
triton installed, in the Triton interpreter: TRITON_INTERPRET=1 python -m pytest tests/test_clo_kernels.py
(the variable must be set before triton is imported, hence not set here), or `bash scripts/interpret_kernels.sh`.
Triton 3.6's interpreter turns a loop's bounds into Python ints in a way newer numpy refuses (the UVA gather's):
numpy 2.2.6 works, 2.4.6 does not.
"""

import os

import pytest
import torch

from kvoffload.kernels.hash_score import block_max, hash_scores_ref, pack_signs
from kvoffload.kernels.head_cache import lookup_and_update_ref
from kvoffload.kernels.radix_keys import count_first_pass_ref, radix_work
from kvoffload.kernels.uva_gather import uva_gather_ref
from kvoffload.offload.retrieval import HashRetriever

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpreter = pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1 to run the kernels on the CPU")


# ---- inputs ------------------------------------------------------------------------------------------------
def gather_case(b, hkv, t, d, h, k, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    host = torch.randn(b, hkv, t, 2, d, generator=g).to(dtype)
    if device == "cuda":
        host = host.pin_memory()
    heads = torch.randperm(hkv, generator=g)[:h].to(device)
    idx = torch.stack([torch.stack([torch.randperm(t, generator=g)[:k] for _ in range(h)]) for _ in range(b)])
    miss = torch.rand(b, h, generator=g) < 0.5
    miss[0, 0] = True
    slots = torch.randn(b, h, k, 2, d, generator=g).to(dtype)
    return host, heads, idx.to(device), miss.to(device), slots.to(device)


def hash_case(b, hk, h, t, g_, rbit, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (b, hk, t, rbit // 8), generator=gen, dtype=torch.uint8)
    norms = torch.rand(b, hk, t, generator=gen) * 10
    qcodes = torch.randint(0, 256, (b, h, g_, rbit // 8), generator=gen, dtype=torch.uint8)
    heads = torch.randperm(hk, generator=gen)[:h]
    return codes.to(device), norms.to(device), qcodes.to(device), heads.to(device)


def lookup_case(b, hc, g_, d, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hc, g_, d, generator=gen)
    # labels near q for some heads, unrelated for others, so both hits and misses occur
    labels = torch.where(
        torch.rand(b, hc, 1, 1, generator=gen) < 0.5,
        q + 0.3 * torch.randn(q.shape, generator=gen),
        torch.randn(q.shape, generator=gen),
    )
    labels[0, 0] = 0.0  # an empty slot's label: cos = 0, as torch.cosine_similarity with eps
    valid = torch.rand(b, hc, generator=gen) < 0.8
    tau = torch.rand(hc, generator=gen) * 1.6 - 0.6
    weights = torch.rand(hc, g_, generator=gen)
    weights[0] = 0.0  # all-zero importance: a plain mean
    force = torch.rand(hc, generator=gen) < 0.2
    return tuple(x.to(device) for x in (q.to(dtype), labels, valid, tau, weights, force))


# ---- the references ----------------------------------------------------------------------------------------
def test_uva_gather_ref_copies_missed_rows_only():
    host, heads, idx, miss, slots = gather_case(2, 4, 50, 8, 3, 5, torch.float32, "cpu")
    before = slots.clone()
    uva_gather_ref(host, heads, idx, miss, slots)
    for b in range(2):
        for j in range(3):
            want = host[b, heads[j], idx[b, j]] if miss[b, j] else before[b, j]
            assert torch.equal(slots[b, j], want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("which", ["random", "all", "none"])
def test_cpu_gather_equals_ref(dtype, which):
    """The CPU transfer (only the missed heads' rows, one index_select) leaves the slots and the bookkeeping as the
    reference does, bit for bit."""
    from kvoffload.kernels.uva_gather import gather_into_cpu
    from kvoffload.offload.transfer import TransferEngine

    host, heads, idx, miss, slots = gather_case(3, 4, 50, 8, 3, 5, dtype, "cpu", seed=2)
    if which != "random":
        miss.fill_(which == "all")
    idx[0, 0, 0] = -1  # the reference reads a negative index from the end
    want = slots.clone()
    record = (torch.randint(0, 50, idx.shape), torch.randint(0, 3, miss.shape, dtype=torch.int32))
    want_record = (record[0].clone(), record[1].clone())
    uva_gather_ref(host, heads, idx, miss, want, want_record)
    got = slots.clone()
    gather_into_cpu(host, heads, idx, miss, got)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    got = slots.clone()
    TransferEngine("uva", 1, torch.device("cpu")).fill(host, heads, idx, miss, got, record=record)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(record[0], want_record[0]) and torch.equal(record[1], want_record[1])


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


# ---- the Triton kernels against the references (shared by the interpreter and the GPU tests) ----------------
def check_uva_gather(device, b, hkv, t, d, h, k, dtype, block=16, programs=1 << 20):
    from kvoffload.kernels.uva_gather import uva_gather

    host, heads, idx, miss, slots = gather_case(b, hkv, t, d, h, k, dtype, device)
    before = slots.clone()
    # the bookkeeping of what moved, from a state where some heads have moved before
    slot_idx, misses = torch.randint(0, t, idx.shape).to(device), torch.randint(0, 3, miss.shape, dtype=torch.int32)
    record = (slot_idx.clone(), misses.clone().to(device))
    uva_gather(host, heads, idx, miss, slots, block=block, programs=programs, record=record)
    want, want_record = before.cpu().clone(), (slot_idx.cpu(), misses.clone())
    uva_gather_ref(host, heads.cpu(), idx.cpu(), miss.cpu(), want, want_record)
    assert torch.equal(record[0].cpu(), want_record[0]) and torch.equal(record[1].cpu(), want_record[1])
    assert torch.equal(want_record[1] - misses, miss.cpu().int())  # one more move for each missed head
    got = slots.cpu()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # bit-exact, NaN-safe
    hit = ~miss.cpu()
    assert torch.equal(got[hit].view(torch.uint8), before.cpu()[hit].view(torch.uint8))  # hits untouched
    bi, ji = miss.cpu().nonzero()[0]
    assert torch.equal(got[bi, ji], host[bi, heads[ji].cpu(), idx[bi, ji].cpu()])  # exactly the selected rows


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


def check_lookup(device, b, hc, g_, d, dtype, aggregation):
    from kvoffload.kernels.head_cache import lookup_and_update_triton

    args = lookup_case(b, hc, g_, d, dtype, device)
    ref_args = tuple(x.cpu().clone() for x in args)
    miss = lookup_and_update_triton(*args, aggregation).cpu()
    want = lookup_and_update_ref(*ref_args, aggregation)
    assert torch.equal(miss, want)
    assert miss.any() and not miss.all()
    assert torch.equal(args[1].cpu(), ref_args[1])  # labels: q (as fp32) where missed, unchanged elsewhere
    assert args[2].all()


@interpreter
@pytest.mark.parametrize("d,block,programs", [(8, 4, 1 << 20), (12, 16, 1 << 20), (8, 4, 1)])  # 12: rows padded to 32
def test_uva_gather_interpreted(d, block, programs):
    """programs=1 < 2 tiles per head: the program loops over the tiles of every missed head."""
    pytest.importorskip("triton")
    check_uva_gather("cpu", 2, 4, 40, d, 3, 7, torch.bfloat16, block, programs)


@interpreter
@pytest.mark.parametrize("programs", [1 << 20, 4, 1])
def test_uva_gather_of_many_short_heads_interpreted(programs):
    """A large batch at a short context: every (sequence, head) pair's top-k is one tile, and the programs, capped
    or not, share the pairs between them (a grid over one head's tiles would be one program)."""
    pytest.importorskip("triton")
    check_uva_gather("cpu", 9, 4, 40, 8, 3, 3, torch.bfloat16, 4, programs)


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


@interpreter
@pytest.mark.parametrize("aggregation", ["mean", "min"])
@pytest.mark.parametrize("g_,d", [(4, 16), (3, 20)])
def test_lookup_interpreted(aggregation, g_, d):
    pytest.importorskip("triton")
    check_lookup("cpu", 3, 6, g_, d, torch.bfloat16, aggregation)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("programs", [1 << 20, 7])  # 7 < 16 tiles per head: programs loop
def test_uva_gather_triton_matches_ref(d, dtype, programs):
    pytest.importorskip("triton")
    check_uva_gather("cuda", 2, 8, 5000, d, 6, 500, dtype, programs=programs)


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [1 << 20, 32])
def test_uva_gather_of_many_short_heads_matches_ref(programs):
    """Figure 10's 1K BSZ 128 shape: 128 sequences x 6 heads of 23 rows, one tile each."""
    pytest.importorskip("triton")
    check_uva_gather("cuda", 128, 8, 1024, 128, 6, 23, torch.bfloat16, block=32, programs=programs)


@pytest.mark.gpu
@pytest.mark.parametrize("rbit,use_heads", [(256, True), (256, False), (128, True)])
@pytest.mark.parametrize("g_", [4, 5])
def test_hash_scores_triton_matches_ref(rbit, use_heads, g_):
    pytest.importorskip("triton")
    check_hash_scores("cuda", 2, 8, 6, 10_000, g_, rbit, use_heads)


@pytest.mark.gpu
@pytest.mark.parametrize("aggregation", ["mean", "min"])
@pytest.mark.parametrize("g_,d,dtype", [(4, 128, torch.bfloat16), (5, 128, torch.float16), (7, 64, torch.float32)])
def test_lookup_triton_matches_ref(aggregation, g_, d, dtype):
    pytest.importorskip("triton")
    check_lookup("cuda", 4, 8, g_, d, dtype, aggregation)


@pytest.mark.gpu
def test_kernels_replay_in_a_cuda_graph():
    """The four kernels are captured once and replayed on new inputs: no host sync inside."""
    pytest.importorskip("triton")
    from kvoffload.kernels.hash_score import hash_scores
    from kvoffload.kernels.head_cache import lookup_and_update
    from kvoffload.kernels.radix_topk import topk_indices
    from kvoffload.kernels.uva_gather import uva_gather

    host, heads, idx, miss, slots = gather_case(1, 8, 3000, 128, 8, 300, torch.bfloat16, "cuda")
    codes, norms, qcodes, _ = hash_case(1, 8, 8, 3000, 4, 256, "cuda")
    q, labels, valid, tau, weights, force = lookup_case(1, 8, 4, 128, torch.bfloat16, "cuda")

    for _ in range(2):  # compile outside the capture
        uva_gather(host, heads, idx, miss, slots.clone())
        topk_indices(hash_scores(codes, norms, qcodes, 256), 300)
        lookup_and_update(q, labels.clone(), valid.clone(), tau, weights, force, "mean")
    labels0, valid0 = labels.clone(), valid.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        m = lookup_and_update(q, labels, valid, tau, weights, force, "mean")
        s = hash_scores(codes, norms, qcodes, 256)
        top = topk_indices(s, 300)
        uva_gather(host, heads, idx, m, slots)
    for seed in (1, 2):
        new_q, new_labels, new_valid = lookup_case(1, 8, 4, 128, torch.bfloat16, "cuda", seed)[:3]
        new_codes = hash_case(1, 8, 8, 3000, 4, 256, "cuda", seed)[0]
        q.copy_(new_q), labels.copy_(new_labels), valid.copy_(new_valid), codes.copy_(new_codes)
        labels0, valid0, before = new_labels.cpu(), new_valid.cpu(), slots.cpu()
        graph.replay()
        torch.cuda.synchronize()
        want_m = lookup_and_update_ref(new_q.cpu(), labels0, valid0, tau.cpu(), weights.cpu(), force.cpu(), "mean")
        assert torch.equal(m.cpu(), want_m) and torch.equal(labels.cpu(), labels0)
        torch.testing.assert_close(s.cpu(), hash_scores_ref(codes.cpu(), norms.cpu(), qcodes.cpu(), 256))
        want_top = s.cpu().topk(300, dim=-1).values.sort(-1).values
        assert torch.equal(s.cpu().gather(-1, top.cpu()).sort(-1).values, want_top)
        uva_gather_ref(host, heads.cpu(), idx.cpu(), want_m, before)
        assert torch.equal(slots.cpu(), before)


def check_append_kv(device, b, hkv, t, d, dtype):
    from kvoffload.kernels.append_kv import append_kv_ref, append_kv_triton

    gen = torch.Generator().manual_seed(4)
    k, v = (torch.randn(b, hkv, d, generator=gen).to(dtype) for _ in "kv")
    window = torch.randn(b, hkv, t, 2, d, generator=gen).to(dtype)
    order = torch.randperm(hkv, generator=gen)
    at = torch.tensor([t - 2])
    want = window.clone()
    append_kv_ref(k, v, want, order, at)
    got = window.to(device)
    append_kv_triton(k.to(device), v.to(device), got, order.to(device), at.to(device))
    assert torch.equal(got.cpu(), want)  # a copy: bit-exact
    assert torch.equal(want[:, 1, t - 2, 0], k[:, order[1]]) and torch.equal(want[:, :, : t - 2], window[:, :, : t - 2])


@interpreter
def test_append_kv_interpreted():
    check_append_kv("cpu", 2, 4, 6, 8, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_append_kv_triton_matches_ref(dtype):
    pytest.importorskip("triton")
    check_append_kv("cuda", 2, 8, 50, 128, dtype)


def check_block_rows(device, r, n, bs, n_tokens, cap):
    from kvoffload.kernels.block_rows import block_rows, block_rows_ref

    gen = torch.Generator().manual_seed(r * n + bs)
    slots = torch.stack([torch.randperm(cap, generator=gen)[:n] for _ in range(r)]).int()
    n_blocks = -(-n_tokens // bs)
    blocks = torch.stack([torch.randperm(n_blocks, generator=gen)[:n] for _ in range(r)]).int()
    blocks[:, 0] = n_blocks - 1  # every row holds the partial last block, where there is one
    want = block_rows_ref(slots, blocks, bs, n_tokens, cap)
    got = block_rows(slots.to(device), blocks.to(device), bs, n_tokens, cap, block=64)
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want))
    rows = want[0].view(r, n, bs)
    assert (rows[:, 0, n_tokens % bs :] == -1).all() if n_tokens % bs else (rows >= 0).all()


@interpreter
@pytest.mark.parametrize("r,n,bs,n_tokens,cap", [(3, 10, 8, 101, 30), (2, 7, 8, 96, 9), (1, 33, 4, 999, 40)])
def test_block_rows_interpreted(r, n, bs, n_tokens, cap):
    pytest.importorskip("triton")
    check_block_rows("cpu", r, n, bs, n_tokens, cap)


@pytest.mark.gpu
@pytest.mark.parametrize("r,n,bs,n_tokens,cap", [(8, 1628, 8, 130_000, 4884), (32, 204, 8, 16_379, 612)])
def test_block_rows_triton_matches_ref(r, n, bs, n_tokens, cap):
    pytest.importorskip("triton")
    check_block_rows("cuda", r, n, bs, n_tokens, cap)


def test_block_rows_ref_marks_the_partial_block():
    from kvoffload.kernels.block_rows import block_rows_ref

    rows, flat = block_rows_ref(torch.tensor([[2, 0]]).int(), torch.tensor([[0, 1]]).int(), 4, 6, 3)
    assert rows.tolist() == [[8, 9, 10, 11, 0, 1, -1, -1]] and flat.tolist() == [[2, 0]]


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
