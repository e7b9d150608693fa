"""CLO's data-movement kernels (UVA gather, CPU gather, head-cache lookup, KV append, block rows) against their
references, and the four kernels of a step replayed in a CUDA graph; the selection kernels (query encoding, hash
scores, radix top-k) are tests/test_clo_select_kernels.py's.

The references run everywhere; the Triton kernels run on the GPU (`-m gpu`) and, on a CPU machine with
triton installed, in the Triton interpreter:
TRITON_INTERPRET=1 python -m pytest tests/test_clo_kernels.py tests/test_clo_select_kernels.py
(the variable must be set before triton is imported, hence not set here), or `bash scripts/interpret_kernels.sh`.
Triton 3.6's interpreter turns a loop's bounds into Python ints in a way newer numpy refuses (the UVA gather's):
numpy 2.2.6 works, 2.4.6 does not.
"""

import pytest
import torch

from kvoffload.kernels.hash_score import hash_scores_ref
from kvoffload.kernels.head_cache import lookup_and_update_ref
from kvoffload.kernels.uva_gather import uva_gather_ref
from tests.clo_kernel_cases import gather_case, hash_case, interpreter, lookup_case


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
