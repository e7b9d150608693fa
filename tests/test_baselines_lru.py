"""RetroInfer-style's CPU block LRU (baselines/lru.py): both backends match a plain OrderedDict LRU on random
traces and each other, access_into and decide_into + update decide as access, small steps stay on the calling
thread, bad settings are refused, and the statistics a run reports match that independent count."""

from collections import OrderedDict

import pytest
import torch

import baselines.lru
from baselines.lru import BlockLRU
from baselines.retroinfer import RetroInfer
from kvoffload.errors import ConfigError
from tests.baseline_helpers import HKV, K_SEL, SINK, T0, B, D, G, L, exact_topk, feed, make


class OrderedDictLRU:
    """The plain LRU the vectorised one must equal: per step, hits are touched first, then misses inserted in
    ascending order, each evicting the least recently used block unless that block was used in this step."""

    def __init__(self, capacity):
        self.capacity, self.od = capacity, OrderedDict()

    def step(self, blocks):
        hits = [x for x in blocks if x in self.od]
        misses = [x for x in blocks if x not in self.od]
        for x in hits:
            self.od.move_to_end(x)
        touched, evictions = set(hits), 0
        for x in misses:
            if len(self.od) >= self.capacity:
                if next(iter(self.od)) in touched:
                    continue  # the cache is full of this step's blocks: x bypasses it
                self.od.popitem(last=False)
                evictions += 1
            self.od[x] = True
            touched.add(x)
        return len(hits), len(misses), evictions


def random_step(g, rows, n_blocks, most=14, width=16):
    """Each row's distinct blocks, sorted (0 to most - 1 of them), and the [rows, width] padded int32 tensor."""
    sets = [
        sorted(set(torch.randint(0, n_blocks, (int(torch.randint(0, most, (1,), generator=g)),), generator=g).tolist()))
        for _ in range(rows)
    ]
    padded = torch.full((rows, width), n_blocks, dtype=torch.int32)
    for r, blocks in enumerate(sets):
        padded[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    return sets, padded


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("capacity", [1, 4, 9, 40])
def test_lru_matches_an_ordered_dict_lru_on_a_random_trace(backend, threads, capacity, monkeypatch):
    monkeypatch.setattr(baselines.lru, "PARALLEL_MIN", 0)  # exercise the torch backend's chunked path too
    monkeypatch.setattr(baselines.lru, "NATIVE_PARALLEL_MIN", 0)  # and the native one's parallel region
    monkeypatch.setattr(baselines.lru, "NATIVE_LOOKUPS_PER_THREAD", 1)
    rows, n_blocks = 5, 30
    g = torch.Generator().manual_seed(capacity)
    lru = BlockLRU(rows, n_blocks, capacity, threads, backend)
    refs = [OrderedDictLRU(capacity) for _ in range(rows)]
    for _ in range(50):
        sets, padded = random_step(g, rows, n_blocks)
        before = [set(ref.od) for ref in refs]
        res = lru.access(padded)
        counts = [ref.step(blocks) for ref, blocks in zip(refs, sets)]
        assert (res.hits, res.lookups - res.hits, res.evictions) == tuple(map(sum, zip(*counts)))
        for r, blocks in enumerate(sets):
            for j, x in enumerate(blocks):  # per block: hit iff cached before; a miss has a place in the list
                assert (int(res.slot[r, j]) >= 0) == (x in before[r]) == (int(res.miss[r, j]) < 0)
            cached = (lru.block_slot[r, :n_blocks] >= 0).nonzero().view(-1)
            assert set(cached.tolist()) == set(refs[r].od)  # the same blocks stay cached
            assert torch.equal(lru.slot_block[r, lru.block_slot[r, cached]], cached)  # and the maps agree
        missed = [(int(r), int(x)) for r, x in zip(res.miss_row, res.miss_block)]
        assert missed == [(r, x) for r, blocks in enumerate(sets) for x in blocks if x not in before[r]]


@pytest.mark.parametrize("threads", [1, 2])
def test_lru_backends_decide_identically(threads, monkeypatch):
    """native and torch: the same LRUStep and the same state, step after step, with the cache often smaller than a
    step's distinct blocks (so misses bypass it), rows of different lengths, empty rows and an empty step."""
    monkeypatch.setattr(baselines.lru, "PARALLEL_MIN", 0)
    monkeypatch.setattr(baselines.lru, "NATIVE_PARALLEL_MIN", 0)
    monkeypatch.setattr(baselines.lru, "NATIVE_LOOKUPS_PER_THREAD", 1)
    rows, n_blocks, capacity = 6, 200, 24
    g = torch.Generator().manual_seed(7)
    native, spec = (BlockLRU(rows, n_blocks, capacity, threads, b) for b in ("native", "torch"))
    assert native.nbytes == spec.nbytes
    bypassed = 0
    for step in range(60):
        sets, padded = random_step(g, rows, n_blocks, most=60 if step % 3 else 8, width=64)
        if step == 10:
            padded.fill_(n_blocks)
        a, b = native.access(padded.long() if step % 2 else padded), spec.access(padded)
        for f in ("slot", "miss", "miss_row", "miss_block", "admit_pos", "admit_slot"):
            assert torch.equal(getattr(a, f), getattr(b, f)), f
        assert (a.lookups, a.hits, a.evictions) == (b.lookups, b.hits, b.evictions)
        bypassed += a.miss_row.numel() - a.admit_pos.numel()
        assert torch.equal(native.block_slot, spec.block_slot) and torch.equal(native.slot_block, spec.slot_block)
        assert torch.equal(native.order(), spec.order())  # the same recency order of the slots
    assert bypassed > 0


def test_lru_access_into_decides_as_access():
    """The graph path's fixed-shape step: every block's slot (hit or just admitted), the host block of each miss,
    the counts, and the same state as access() step after step (n distinct blocks per row, n <= capacity)."""
    rows, n_blocks, capacity, n = 4, 60, 12, 9
    g = torch.Generator().manual_seed(3)
    ref, got = (BlockLRU(rows, n_blocks, capacity, 2) for _ in range(2))
    for _ in range(40):
        blocks = torch.stack([torch.randperm(n_blocks, generator=g)[:n].sort().values for _ in range(rows)]).int()
        a = ref.access(blocks)
        dest, src = torch.empty(rows, n, dtype=torch.int32), torch.empty(rows, n, dtype=torch.int32)
        counts = torch.zeros(3, dtype=torch.int64)
        got.access_into(blocks.numpy(), dest.numpy(), src.numpy(), counts.numpy())
        assert tuple(counts.tolist()) == (a.lookups, a.hits, a.evictions)
        hit = a.slot >= 0
        assert torch.equal(dest[hit], a.slot[hit].int()) and torch.equal(src[hit], torch.full_like(src[hit], -1))
        admitted = torch.full((rows, n), -1, dtype=torch.int64)
        admitted[a.miss_row[a.admit_pos], (a.miss >= 0).nonzero()[a.admit_pos][:, 1]] = a.admit_slot
        assert torch.equal(dest[~hit], admitted[~hit].int())  # every miss admitted, into access()'s slot
        assert torch.equal(src[~hit], (torch.arange(rows)[:, None] * n_blocks + blocks)[~hit])
        assert torch.equal(ref.block_slot, got.block_slot) and torch.equal(ref.order(), got.order())


def test_lru_decide_then_update_equals_access_into():
    """The deferred path (RetroInfer's thread pool updates the LRU beside the step's GPU work): decide_into
    gives access_into's every output with the state untouched, and update then leaves access_into's state."""
    rows, n_blocks, capacity, n = 4, 60, 12, 9
    g = torch.Generator().manual_seed(5)
    ref, got = (BlockLRU(rows, n_blocks, capacity, 2) for _ in range(2))
    for _ in range(40):
        blocks = torch.stack([torch.randperm(n_blocks, generator=g)[:n].sort().values for _ in range(rows)]).int()
        outs = [
            (
                torch.empty(rows, n, dtype=torch.int32),
                torch.empty(rows, n, dtype=torch.int32),
                torch.zeros(3, dtype=torch.int64),
            )
            for _ in range(2)
        ]
        ref.access_into(blocks.numpy(), *(t.numpy() for t in outs[0]))
        before = (got.block_slot.clone(), got.slot_block.clone(), got.order())
        got.decide_into(blocks.numpy(), *(t.numpy() for t in outs[1]))
        assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[1]))
        assert all(torch.equal(a, b) for a, b in zip(before, (got.block_slot, got.slot_block, got.order())))
        got.update(blocks.numpy())
        assert torch.equal(ref.block_slot, got.block_slot) and torch.equal(ref.slot_block, got.slot_block)
        assert torch.equal(ref.order(), got.order())


def test_lru_small_steps_run_on_the_calling_thread(monkeypatch):
    """A step of few lookups (SmolLM2's 3 KV heads on a CPU) runs without a parallel region: waking its threads
    costs more than the work, and on shared cores a region can wait a scheduler slice for a descheduled thread."""
    asked = []
    monkeypatch.setattr(baselines.lru.numba, "set_num_threads", asked.append)
    monkeypatch.setattr(baselines.lru.numba.config, "NUMBA_NUM_THREADS", 4)
    rows, n_blocks = 4, 1000
    lru = BlockLRU(rows, n_blocks, 400, threads=4)
    small = torch.arange(rows * 16, dtype=torch.int32).view(rows, 16)  # 64 lookups
    middle = torch.arange(rows * 150, dtype=torch.int32).view(rows, 150)  # 600: above it, work for 3 threads
    large = torch.arange(rows * 200, dtype=torch.int32).view(rows, 200)  # 800: for 4, every row its own
    counts = torch.zeros(3, dtype=torch.int64).numpy()
    lru.access(small)
    for blocks in (large, middle, small):
        out = torch.zeros_like(blocks).numpy(), torch.zeros_like(blocks).numpy()
        lru.access_into(blocks.numpy(), *out, counts)
    assert small.numel() < baselines.lru.NATIVE_PARALLEL_MIN <= middle.numel()
    assert asked == [1, 4, 3, 1] and lru.step_threads == 1  # the last step's count, for the record


def test_lru_refuses_bad_threads_and_backend():
    with pytest.raises(ConfigError, match="threads"):
        BlockLRU(2, 10, 4, threads=0)
    with pytest.raises(ConfigError, match="backend"):
        BlockLRU(2, 10, 4, backend="cuda")


def test_retroinfer_statistics_match_an_independent_trace():
    bs = 8
    s = make(RetroInfer, retriever="exact", block_size=bs, cache_multiple=1.5, selection="token")
    _, (k0, v0, data), stats = feed(s, seed=4)
    cap = s.geometry(T0)[2]
    refs = {(layer, b, h): OrderedDictLRU(cap) for layer in range(L) for b in range(B) for h in range(HKV)}
    for step, inputs in enumerate(data):
        hits = lookups = 0
        for (layer, b, h), ref in refs.items():
            top = exact_topk(inputs[layer][0][b, h * G : (h + 1) * G], k0[layer, b, h])
            hit, miss, _ = ref.step(sorted(set(((top - SINK) // bs).tolist())))
            hits, lookups = hits + hit, lookups + hit + miss
        st = stats[step]
        assert (st.hits, st.lookups) == (hits, lookups)
        assert st.bytes_h2d == (lookups - hits) * bs * 2 * D * 4  # missed blocks x block x row bytes
        assert st.bytes_d2h == L * B * HKV * K_SEL * 4 and st.host_syncs == L  # block ids, one sync per layer
        assert set(st.phase_ms) >= {"retrieval", "cache_mgmt", "transfer_exposed", "attention", "launch_sync"}
        assert min(st.phase_ms[p] for p in ("retrieval", "cache_mgmt", "transfer_exposed", "attention")) > 0
    assert 0 < sum(x.hits for x in stats) < sum(x.lookups for x in stats)
