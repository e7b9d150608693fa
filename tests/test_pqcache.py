"""PQCache-style (baselines/pqcache.py) and its LFU (baselines/lfu.py): the compiled LFU decides as PQCache's count
lists do; with the exact retriever the system attends exactly the top-k tokens whatever its cache holds, and its
cache serves hits from the second step on."""

import pytest
import torch

from baselines.lfu import BlockLFU, LFUReference
from baselines.pqcache import PQCache
from kvoffload.errors import ConfigError
from kvoffload.kv.interface import KVSpec
from tests.reference import exact_topk_attention
from tests.test_full_budget_exact import HKV, RECENT, SINK, STEPS, B, D, H, L, assert_outputs, feed, inputs

CPU = torch.device("cpu")


@pytest.mark.parametrize("capacity", [1, 3, 8])
def test_lfu_decides_as_pqcache_count_lists(capacity):
    g = torch.Generator().manual_seed(capacity)
    n_blocks, batch = 12, 2
    lfu = BlockLFU(batch, n_blocks, capacity)
    refs = [LFUReference(capacity) for _ in range(batch)]
    for _ in range(40):
        ids = torch.stack([torch.randperm(n_blocks, generator=g)[:5] for _ in range(batch)])
        ids[:, 4] = -1  # a row padded with "none"
        before = torch.from_numpy(lfu.block_slot.copy())
        slots, new, evictions = lfu.insert(ids)
        want_evictions = 0
        for b, ref in enumerate(refs):
            for blk in ids[b].tolist():
                if blk >= 0:
                    want_evictions += ref.insert(blk) is not None
            cached = {int(x) for x in (lfu.block_slot[b] >= 0).nonzero()[0]}
            assert cached == set(ref.uses)  # the same blocks cached, after every batch
            assert sorted(lfu.slot_uses[b][lfu.slot_block[b] >= 0].tolist()) == sorted(ref.uses.values())
        assert evictions == want_evictions
        rows = torch.arange(batch)[:, None]
        valid = ids >= 0
        assert torch.equal(slots[valid], torch.from_numpy(lfu.block_slot)[rows, ids.clamp(min=0)][valid])
        assert torch.equal(
            new, valid & (slots >= 0) & (slots != torch.where(valid, before[rows, ids.clamp(min=0)], -1))
        )


def make(t0, device=CPU, **kw):
    s = PQCache(**{"sink": SINK, "recent": RECENT, "dense_layers": 1, "cpu_threads": 2, **kw})
    link = None if device.type == "cpu" else 50.0  # on CUDA the runner measures it; here it only sets the floor
    s.allocate(KVSpec(L, B, t0 + STEPS, H, HKV, D, torch.float32, device, prompt_len=t0, link_gb_s=link))
    return s


@pytest.mark.parametrize("cache_tokens", [0, 16, 10_000])  # no cache, two 8-token blocks, every block
def test_exact_retriever_attends_the_exact_topk_whatever_the_cache_holds(cache_tokens):
    t0, ratio = 123, 0.3
    s = make(t0, retriever="exact", topk_ratio=ratio, block_size=8, cache_tokens=cache_tokens, admit_blocks=4)
    k0, v0, data = inputs(t0, seed=3)
    want = exact_topk_attention(k0, v0, data, SINK, RECENT, s.k_select(t0), dense_layers=1)
    got = feed(s, k0, v0, data)
    assert_outputs(got, want)
    if cache_tokens:
        assert s.evictions > 0 or cache_tokens > 100
        assert s.describe()["cache_blocks_per_sequence"] == min(cache_tokens // 8, 14)


def test_cached_blocks_serve_hits_and_count_their_copies():
    t0 = 123
    s = make(t0, retriever="exact", topk_ratio=0.3, block_size=8, cache_tokens=10_000, admit_blocks=14)
    k0, v0, data = inputs(t0, seed=4)
    stats = []
    for layer in range(L):
        s.prefill(layer, k0[layer], v0[layer])
    s.end_prefill(t0)
    for step in data:
        s.begin_step()
        for layer, (q, k, v) in enumerate(step):
            s.decode(layer, q, k, v)
        stats.append(s.end_step())
    assert stats[0].hits == 0 and stats[0].lookups > 0  # an empty cache: every token missed
    assert stats[-1].hits > 0  # the blocks the first steps admitted serve later ones
    assert all(x.host_syncs == L - 1 for x in stats)  # a sparse layer's one: its misses and ranked blocks
    # the floor's host part holds the misses' CPU gather at its bandwidth alone, measured once on a step's rows
    alone = s.describe()["cpu_gather_gb_s"]["alone_by_threads"]
    assert s.cpu_threads in alone and min(alone.values()) > 0
    missed = (stats[0].lookups - stats[0].hits) * s.spec.row_bytes
    assert stats[0].host_work_ms >= missed / (max(s.gather_alone.values()) * 1e6) > 0


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(retriever="hash"), "retriever"),
        (dict(block_size=0), "block_size"),
        (dict(cache_tokens=-1), "cache_tokens"),
        (dict(topk="heap"), "topk"),
    ],
)
def test_bad_settings_are_refused(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        PQCache(**kw)


@pytest.mark.gpu
@pytest.mark.parametrize("transfer", ["cpu_gather", "uva"])
def test_on_cuda_it_attends_the_exact_topk(transfer):
    """The pinned host store, the CUDA gathers and the radix select: the exact top-k, as on the CPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cuda = torch.device("cuda")
    t0 = 123
    kw = dict(retriever="exact", topk_ratio=0.3, block_size=8, cache_tokens=16, admit_blocks=4, transfer=transfer)
    s = make(t0, cuda, **kw)
    k0, v0, data = inputs(t0, seed=3)
    want = exact_topk_attention(k0, v0, data, SINK, RECENT, s.k_select(t0), dense_layers=1)
    to = lambda x: x.to(cuda)  # noqa: E731
    got = feed(s, to(k0), to(v0), [[tuple(map(to, x)) for x in step] for step in data])
    # the decode kernel's fp32 dots run in TF32 (Triton's default), ~1e-3 off; one token missed from the top-k moves
    # an output by about its 1/k share of the attention, far beyond this
    for s_got, s_want in zip(got, want):
        for g, w in zip(s_got, s_want):
            torch.testing.assert_close(g.cpu(), w, atol=2e-3, rtol=1e-3)
    assert s.evictions > 0
