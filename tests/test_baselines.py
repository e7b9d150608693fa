"""The RetroInfer- and InfiniGen-style baselines through the KVOffloadSystem API (CPU reference path): with the
exact retriever (any cache size) RetroInfer-style output equals exact top-k attention recomputed from the full KV;
InfiniGen-style does too with the real query; the CPU LRU matches a plain OrderedDict LRU, and the statistics a
run reports match that independent count; memory is the real buffers; bad input is refused."""

import json
import math
import os
import subprocess
import sys
import tempfile
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import baselines.lru
from baselines.cpu_fetch import ALL_CORES_FETCH_BYTES, ALL_CORES_FETCH_BYTES_BSZ1, gather_threads
from baselines.infinigen import InfiniGen
from baselines.lru import BlockLRU
from baselines.retroinfer import RetroInfer
from clo.plan import k_select
from clo.system import CLO
from kvoffload.errors import ConfigError
from kvoffload.kv.interface import KVSpec, split_host
from tests.offload_double import DeferredOffload
from tests.reference import exact_topk_attention, topk_middle

B, H, HKV, D, L, T0, STEPS = 2, 8, 2, 16, 3, 123, 4  # T0 - sink - recent = 111: a partial last block
G = H // HKV
SINK, RECENT, RATIO = 4, 8, 0.25
K_SEL = math.ceil(RATIO * T0) - SINK - RECENT
CPU = torch.device("cpu")


def spec(budget=None):
    return KVSpec(L, B, T0 + STEPS, H, HKV, D, torch.float32, CPU, budget)


def make(cls, **kw):
    s = cls(**{**dict(sink=SINK, recent=RECENT, topk_ratio=RATIO, dense_layers=0, cpu_threads=2), **kw})
    s.allocate(spec())
    return s


def feed(system, seed=0, speculate_with_true_query=False):
    """Random prompt and decode inputs through the API; per step the outputs of every layer, and the data."""
    g = torch.Generator().manual_seed(seed)
    k0, v0 = torch.randn(L, B, HKV, T0, D, generator=g), torch.randn(L, B, HKV, T0, D, generator=g)
    for layer in range(L):
        system.prefill(layer, k0[layer], v0[layer])
    system.end_prefill(T0)
    outs, data, stats = [], [], []
    for _ in range(STEPS):
        step = [
            (
                torch.randn(B, H, D, generator=g),
                torch.randn(B, HKV, D, generator=g),
                torch.randn(B, HKV, D, generator=g),
            )
            for _ in range(L)
        ]
        data.append(step)
        system.begin_step()
        row = []
        for layer in range(L):
            if speculate_with_true_query and layer + 1 < L:
                system.prepare(layer + 1, step[layer + 1][0])  # the model's one-layer-ahead call, exact query
            row.append(system.decode(layer, *step[layer]))
        outs.append(row)
        stats.append(system.end_step())
    return outs, (k0, v0, data), stats


def exact_topk(q, keys):
    return topk_middle(q, keys, SINK, RECENT, K_SEL)


def reference(k0, v0, data, dense_layers=0):
    return exact_topk_attention(k0, v0, data, SINK, RECENT, K_SEL, dense_layers)


def assert_outputs(got, want):
    for s in range(STEPS):
        for layer in range(L):
            torch.testing.assert_close(got[s][layer], want[s][layer], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("cache_multiple", [100.0, 1.0])  # holds everything | evicts and bypasses every step
@pytest.mark.parametrize("block_size", [8, 5])
def test_retroinfer_with_exact_retriever_equals_exact_topk_attention(cache_multiple, block_size):
    s = make(
        RetroInfer,
        retriever="exact",
        block_size=block_size,
        cache_multiple=cache_multiple,
        dense_layers=1,
        selection="token",
    )
    got, (k0, v0, data), stats = feed(s)
    assert_outputs(got, reference(k0, v0, data, dense_layers=1))
    if cache_multiple > 10:  # everything fits: after the first step only newly retrieved blocks miss
        assert s.geometry(T0)[2] == s.geometry(T0)[0] and stats[-1].hits > 0
    else:
        assert s.evictions > 0


def test_retroinfer_block_selection_attends_whole_top_blocks_and_moves_no_extra_bytes():
    """Default selection: the k // block_size blocks with the best token, exactly, the partial last block among
    the candidates (T0's middle, 111 tokens, is 13 blocks of 8 and one of 7); a miss moves only the selected
    blocks' rows (no block amplification; the partial block's padding row travels with it, never attended)."""
    bs = 8
    s = make(RetroInfer, retriever="exact", block_size=bs, cache_multiple=100.0)
    k_blk = s.k_select(T0)
    assert k_blk == (K_SEL // bs) * bs and k_blk > 0
    got, (k0, v0, data), stats = feed(s)
    assert_outputs(got, exact_topk_attention(k0, v0, data, SINK, RECENT, k_blk // bs, block_size=bs))
    for st in stats:
        assert st.bytes_h2d == (st.lookups - st.hits) * bs * 2 * D * 4 <= L * B * HKV * k_blk * 2 * D * 4


def test_infinigen_with_the_true_query_equals_exact_topk_attention():
    s = make(InfiniGen, oracle_query=True)
    got, (k0, v0, data), stats = feed(s)
    assert_outputs(got, reference(k0, v0, data))
    assert stats[-1].bytes_h2d == L * B * HKV * K_SEL * 2 * D * 4 and stats[-1].host_syncs == 2 * L


def test_infinigen_speculation_with_all_channels_and_the_true_query_is_exact():
    """The speculative path itself: prepare() one layer ahead, skewed partial keys; with every channel kept the
    skew is an orthogonal change of basis, so the scores (and the top-k) are exact."""
    s = make(InfiniGen, channel_fraction=1.0)
    got, (k0, v0, data), _ = feed(s, speculate_with_true_query=True)
    assert_outputs(got, reference(k0, v0, data))


def test_infinigen_partial_channels_recover_most_of_the_exact_topk():
    s = make(InfiniGen, channel_fraction=0.5)
    g = torch.Generator().manual_seed(3)
    # keys with a few dominant directions (as real keys): the partial channels then carry most of q.k
    keys = torch.randn(B, HKV, T0, 4, generator=g) @ torch.randn(4, D, generator=g) * 3 + 0.1 * torch.randn(
        B, HKV, T0, D, generator=g
    )
    for layer in range(L):
        s.prefill(layer, keys, torch.randn(B, HKV, T0, D, generator=g))
    s.end_prefill(T0)
    q = torch.randn(B, H, D, generator=g)
    s.fetch(0, q)
    got = s.pending.pop(0)[0][:, :, :, 0]  # fetched keys [B, HKV, k, D]
    for b in range(B):
        for h in range(HKV):
            want = set(exact_topk(q[b, h * G : (h + 1) * G], keys[b, h]).tolist())
            fetched = {int(torch.nonzero((keys[b, h] == row).all(-1))[0]) for row in got[b, h]}
            assert len(want & fetched) >= 0.8 * K_SEL


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


@pytest.mark.parametrize(
    "cls, kw",
    [
        (RetroInfer, {}),
        (RetroInfer, {"selection": "token"}),
        (RetroInfer, {"retriever": "exact", "block_size": 5, "selection": "token"}),
        (RetroInfer, {"retriever": "wave", "wave_segment": 40, "wave_estimate": 0}),  # tests/test_wave_estimate.py
        (RetroInfer, {"retriever": "pq"}),
        (InfiniGen, {}),
        (InfiniGen, {"oracle_query": True}),
    ],
)
def test_memory_is_the_real_buffers_and_matches_the_estimate(cls, kw):
    s = make(cls, dense_layers=1, **kw)
    feed(s)
    parts = s.memory_parts()
    assert parts == s.estimate_parts(KVSpec(**{**spec().__dict__, "prompt_len": T0}))
    held = s.memory_held()
    assert held.device_bytes + held.host_bytes == sum(parts.values())
    assert parts["dense_layers"] == s.dense.kv[0].nbytes and parts["window"] > 0 and parts["host"] > 0
    n = STEPS + 1  # tokens generated by the next step, the one step_device_bytes describes
    attended = (L - 1) * B * HKV * (SINK + RECENT + n + s.k_select(T0)) + B * HKV * (T0 + n)  # rows it reads
    assert s.step_device_bytes() == attended * 2 * D * 4 + parts["metadata"]
    est = s.estimate_memory(spec())  # (no prompt_len: a prompt of max_len) refuses a too small budget
    if cls is RetroInfer:  # below its default cache it shrinks the cache to the budget, down to one step's blocks
        smallest = split_host(s.estimate_parts(spec(), 1.0))
        assert smallest.device_bytes < est.device_bytes
        est = smallest
    with pytest.raises(ConfigError, match="budget"):
        cls(**{**dict(sink=SINK, recent=RECENT, topk_ratio=RATIO, dense_layers=1), **kw}).allocate(
            spec(est.device_bytes - 1)
        )
    cls(**{**dict(sink=SINK, recent=RECENT, topk_ratio=RATIO, dense_layers=1), **kw}).allocate(spec(est.device_bytes))


def test_budget_rule_is_clos():
    for t0 in (50, 123, 3072, 131072):
        clo = CLO(sink=SINK, recent=RECENT, topk_ratio=RATIO)
        assert RetroInfer(sink=SINK, recent=RECENT, topk_ratio=RATIO, selection="token").k_select(t0) == k_select(
            clo.cfg, t0
        )


@pytest.mark.parametrize(
    "make_bad, match",
    [
        (lambda: RetroInfer(block_size=0), "block_size"),
        (lambda: RetroInfer(cache_multiple=0.5), "working set"),
        (lambda: RetroInfer(cpu_threads=0), "cpu_threads"),
        (lambda: InfiniGen(cpu_threads=0), "cpu_threads"),
        (lambda: RetroInfer(cpu_threads=100_000), "exceeds the .* cores"),
        (lambda: RetroInfer(retriever="ivf"), "retriever"),
        (lambda: RetroInfer(retriever="wave", wave_cluster_size=0), "cluster_size"),
        (lambda: RetroInfer(transfer="dma"), "transfer"),
        (lambda: RetroInfer(uva_programs=0), "uva_programs"),
        (lambda: RetroInfer(lru_update="async"), "lru_update"),
        (lambda: InfiniGen(topk="heap"), "topk"),
        (lambda: InfiniGen(channel_fraction=0.0), "channel_fraction"),
        (lambda: InfiniGen(fetch_chunk_rows=0), "fetch_chunk_rows"),
        (lambda: InfiniGen(dense_layers=L + 1).allocate(spec()), "dense_layers"),
        (lambda: InfiniGen(graphs="always"), "graphs"),
        (lambda: InfiniGen(graphs="on").allocate(spec()), "graphs=on needs a CUDA device"),
    ],
)
def test_bad_input_is_a_config_error(make_bad, match):
    with pytest.raises(ConfigError, match=match):
        make_bad()


ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.parametrize("system", ["retroinfer", "infinigen"])
def test_run_command_with_real_smollm2(system, tmp_path):
    env = {**os.environ, "WANDB_SILENT": "true", "HYDRA_FULL_ERROR": "0"}
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.run",
            f"system={system}",
            "wandb.enabled=false",
            f"results_dir={tmp_path / 'results'}",
            f"hydra.run.dir={tmp_path / 'out'}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    (path,) = (tmp_path / "results").glob("*/record.json")
    rec = json.loads(path.read_text())
    assert rec["status"] == "ok" and rec["system"] == system and "real SmolLM2" in rec["weights"]
    assert rec["answer"]["found"] is True, rec["answer"]
    m = rec["metrics"]
    assert m["bytes_h2d_per_step"] > 0 and m["host_syncs_per_step"] > 0 and m["phase_ms_per_step"]["attention"] > 0
    if system == "retroinfer":
        assert 0 < m["hit_rate"] < 1 and m["phase_ms_per_step"]["cache_mgmt"] > 0
    assert rec["system_state"]["memory_parts"]["host"] > 0


@pytest.mark.slow
def test_real_smollm2_needle_answers_equal_fullattn(smollm2_folder):
    """At the default top-k 10 %, both baselines give FullAttn's greedy answer on the needle prompt."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from transformers import AutoTokenizer

    from baselines.fullattn import FullAttn
    from experiments.workloads.prompts import build_prompt
    from kvoffload.generate import generate
    from kvoffload.model.config import ModelConfig
    from kvoffload.model.weights import hf_decoder

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfgs = {name: compose("config", overrides=[f"system={name}"]) for name in ("retroinfer", "infinigen")}
    mcfg = ModelConfig.from_mapping(cfgs["retroinfer"].model)
    model = hf_decoder(mcfg, smollm2_folder, CPU, torch.float32)
    tok = AutoTokenizer.from_pretrained(str(smollm2_folder))
    prompt = build_prompt("needle", 3072, 1, 0, tok)

    def text(system):
        system.allocate(
            KVSpec(mcfg.num_layers, 1, 3072 + 24, mcfg.num_heads, mcfg.num_kv_heads, mcfg.head_dim, torch.float32, CPU)
        )
        return tok.decode(
            generate(model, system, prompt.tokens, 24, {tok.eos_token_id}).tokens[0], skip_special_tokens=True
        )

    want = text(FullAttn())
    assert prompt.answer in want
    for name, cfg in cfgs.items():
        assert text(instantiate(cfg.system)) == want, name


def test_infinigen_offline_skew_file_is_used_and_checked():
    bases = torch.linalg.qr(torch.randn(L, HKV, D, D)).Q.to(torch.float16)
    path = Path(tempfile.mkdtemp()) / "skew.pt"
    torch.save(bases, path)
    s = make(InfiniGen, skew=str(path), channel_fraction=0.5)
    feed(s)
    torch.testing.assert_close(s.basis[1][0], bases[1, :, :, : D // 2].float())
    assert "offline" in s.describe()["skew"]
    torch.save(bases[:, :1], path)
    with pytest.raises(ConfigError, match="shape"):
        make(InfiniGen, skew=str(path))
    with pytest.raises(ConfigError, match="no such file"):
        make(InfiniGen, skew=str(path) + ".missing")


# ---- RetroInfer's wave index -------------------------------------------------------------------------------
def test_wave_index_recovers_planted_clusters_and_retrieves_the_best_first():
    """Keys around 3 well-separated centres, interleaved in token order: k-means (6 clusters, each centre among
    the evenly spaced starting keys) keeps every cluster to one centre, the layout makes each cluster a
    contiguous run, and a query along one centre retrieves that centre's keys before any other."""
    from baselines.wave_index import WaveRetriever

    g = torch.Generator().manual_seed(0)
    centres = torch.nn.functional.normalize(torch.randn(3, D, generator=g), dim=-1) * 4
    truth = (torch.arange(96) % 3).expand(B, HKV, 96)
    keys = centres[truth] + 0.05 * torch.randn(B, HKV, 96, D, generator=g)
    w = WaveRetriever(1, cluster_size=16, segment=96, iters=6)
    w.index(0, keys)
    ordered = truth.gather(2, w.perm[0])  # the true centre of each position, in the cluster-ordered layout
    runs = (ordered[..., 1:] != ordered[..., :-1]).sum(-1)
    assert (runs <= 5).all()  # 6 pure clusters in a row: at most 5 changes of centre (interleaved: 95)
    q = torch.zeros(B, H, D)
    q[:, :, :] = centres[2]
    top = w.scores(0, q, torch.arange(HKV)).topk(4, dim=-1).indices
    assert (ordered.gather(2, top) == 2).all()


def test_wave_index_with_one_key_per_cluster_is_the_exact_retriever():
    """cluster_size 1: every key its own centroid, the layout the token order, the scores q . k: RetroInfer with
    the wave index and no estimation zone equals exact top-k attention, as with the exact retriever."""
    s = make(
        RetroInfer,
        retriever="wave",
        wave_cluster_size=1,
        wave_estimate=0,
        block_size=5,
        cache_multiple=100.0,
        dense_layers=1,
        selection="token",
    )
    got, (k0, v0, data), _ = feed(s)
    assert_outputs(got, reference(k0, v0, data, dense_layers=1))


def test_retroinfer_with_the_wave_index_attends_real_rows_of_its_clusters():
    """The permuted host store still pairs every key with its value: at top-k 100% RetroInfer with the wave
    index (which attends every middle token, in cluster order) equals dense attention."""
    kw = dict(topk_ratio=1.0, dense_layers=0, cache_multiple=100.0, selection="token", block_size=4)
    s = RetroInfer(sink=SINK, recent=RECENT, retriever="wave", wave_segment=40, cpu_threads=2, **kw)
    s.allocate(spec())
    got, (k0, v0, data), stats = feed(s)
    want = exact_topk_attention(k0, v0, data, SINK, RECENT, T0 - SINK - RECENT, 0)
    assert_outputs(got, want)
    assert "wave index" in s.describe()["retriever"]
    assert s.describe()["lru_step_threads"] == [1]  # a few lookups a layer: the calling thread (NATIVE_PARALLEL_MIN)


def test_retroinfers_lru_is_timed_as_its_host_work():
    """The CPU-side LRU of every sparse layer is the step's host work (StepStats.host_work_ms), the third part of
    the system's own floor; FullAttn-like dense decoding has none."""
    s = make(RetroInfer, retriever="exact")
    _, _, stats = feed(s)
    assert all(st.host_work_ms > 0 for st in stats)
    dense = make(RetroInfer, retriever="exact", dense_layers=L)
    assert all(st.host_work_ms == 0 for st in feed(dense)[2])


def test_retroinfers_cache_fitted_to_any_budget_fits_it():
    """Between the smallest cache (one step's blocks) and the configured one, every budget gets the largest cache
    that fits: its estimate is within the budget, one slot more would not be (prompts of several lengths: the
    slot counts that a float multiple must reproduce exactly)."""
    s = RetroInfer(sink=SINK, recent=RECENT, topk_ratio=RATIO, dense_layers=1, retriever="exact", block_size=1)
    for t in range(T0 - 90, T0 + 1, 3):
        sp = replace(spec(), max_len=t + STEPS, prompt_len=t)
        lo, hi = (split_host(s.estimate_parts(sp, m)).device_bytes for m in (1.0, 3.0))
        per_step = s.geometry(t, 1.0)[1]
        for budget in range(lo, hi, max((hi - lo) // 23, 1)):
            fitted = s.fit_multiple(replace(sp, gpu_budget_bytes=budget))
            assert split_host(s.estimate_parts(sp, fitted)).device_bytes <= budget, (t, budget)
            assert split_host(s.estimate_parts(sp, fitted + 1 / per_step)).device_bytes > budget


def test_the_cpu_gather_calibration_gathers_whole_rows_and_reports_a_bandwidth():
    """InfiniGen-style's floor divides its gathered bytes by this (baselines/cpu_fetch.gather_gb_s)."""
    from baselines.cpu_fetch import gather_gb_s

    host = torch.arange(5000 * 8, dtype=torch.float32).view(5000, 8)
    before = host.clone()
    staging = torch.zeros(3000, 8)
    gb_s = gather_gb_s(host, staging, threads=1)
    assert gb_s > 0 and torch.equal(host, before)
    rows = (staging[:, 0] / 8).long()
    assert torch.equal(staging, host[rows])  # every staged row is a whole host row
    assert rows.unique().numel() > 2000  # random rows, not one repeated
    idx = torch.tensor([4999, 7, 7, 0])  # a step's own indices: exactly those rows, in order
    assert gather_gb_s(host, staging, threads=1, idx=idx) > 0
    assert torch.equal(staging[:4], host[idx])
    layers = [host, host + 1.0, host + 2.0]  # a pass reads every layer's store in turn: the last one's rows remain
    assert gather_gb_s(layers, staging, threads=1, idx=idx, repeats=1) > 0
    assert torch.equal(staging[:4], layers[2][idx])


def test_infinigen_prefill_in_chunks_keeps_the_partial_keys(monkeypatch):
    """The partial keys and skew basis, built a chunk of tokens at a time (bounded fp32 temporaries), span what
    one pass over all of them gives: the keys' projections onto the basis agree."""
    import baselines.infinigen as ig

    g = torch.Generator().manual_seed(5)
    keys = torch.randn(B, HKV, T0, 4, generator=g) @ torch.randn(4, D, generator=g) + 0.1 * torch.randn(
        B, HKV, T0, D, generator=g
    )
    values = torch.randn(B, HKV, T0, D, generator=g)
    built = []
    for chunk_bytes in (1 << 30, B * HKV * D * 4 * 3):  # one chunk; three tokens a chunk
        monkeypatch.setattr(ig, "PREFILL_CHUNK_BYTES", chunk_bytes)
        s = make(InfiniGen, channel_fraction=0.5)
        s.prefill(0, keys, values)
        built.append(s.partial[0] @ s.basis[0].transpose(-1, -2))  # [B, HKV, n, D]: sign-free
    assert built[0].shape[2] == T0 - SINK - RECENT
    torch.testing.assert_close(built[1], built[0], rtol=1e-3, atol=1e-3)  # fp32 sums in another order


def tensors_of(obj, depth: int = 3):
    """Every tensor an object holds in its attributes, lists, tuples and dicts, `depth` objects down."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from tensors_of(x, depth)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from tensors_of(x, depth)
    elif depth and hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("baselines", "kvoffload"):
        for x in vars(obj).values():
            yield from tensors_of(x, depth - 1)


@pytest.mark.parametrize(
    "cls, kw",
    [
        (InfiniGen, {}),
        (InfiniGen, {"oracle_query": True}),
        (RetroInfer, {}),
        (RetroInfer, {"retriever": "exact"}),
        (RetroInfer, {"retriever": "wave", "wave_cluster_size": 8}),
    ],
)
def test_prefill_hands_a_view_of_the_keys_and_keeps_no_view_of_them(cls, kw, monkeypatch):
    """The middle keys reach prefill_sparse as a view of the prompt's K (a copy would add one more layer's K to the
    prefill's peak), and nothing the system keeps shares the prompt's K (a view would hold all of it), at batch 1
    with one KV head too, where the slice is contiguous."""
    for b, hkv in ((B, HKV), (1, 1)):
        s = cls(**{**dict(sink=SINK, recent=RECENT, topk_ratio=RATIO, dense_layers=0, cpu_threads=2), **kw})
        s.allocate(KVSpec(L, b, T0 + STEPS, hkv * G, hkv, D, torch.float32, CPU))
        seen, real = [], s.prefill_sparse
        spy = lambda layer, keys, *rest: (seen.append(keys), real(layer, keys, *rest))[1]
        monkeypatch.setattr(s, "prefill_sparse", spy)
        ks = [torch.randn(b, hkv, T0, D) for _ in range(L)]
        for layer, k in enumerate(ks):
            s.prefill(layer, k, torch.randn_like(k))
        s.end_prefill(T0)
        prompt = {k.untyped_storage().data_ptr() for k in ks}
        assert all(x.untyped_storage().data_ptr() in prompt for x in seen)
        del seen[:]
        kept = [t for t in tensors_of(s) if t.untyped_storage().data_ptr() in prompt]
        assert not kept, [tuple(t.shape) for t in kept]


@pytest.mark.parametrize(
    "cls, kw",
    [(InfiniGen, {}), (RetroInfer, {}), (RetroInfer, {"retriever": "wave", "wave_cluster_size": 8})],
)
def test_host_stores_are_allocated_before_prefill_and_copied_while_the_next_layer_computes(cls, kw):
    """With the prompt's length known, every sparse layer's pinned host store exists before the prefill and the
    prefill fills that very buffer; its copy deferred to the latest moment the CUDA path allows (the next layer's
    prefill, or end_prefill) leaves the stores and every decode output as the synchronous copy does (the wave
    index reorders the rows before their copy)."""
    runs = []
    for deferred in (False, True):
        s = cls(**{**dict(sink=SINK, recent=RECENT, topk_ratio=RATIO, dense_layers=1, cpu_threads=2), **kw})
        s.allocate(replace(spec(), prompt_len=T0))
        stores = list(s.host)
        assert stores[0] is None and all(h is not None for h in stores[1:])
        if deferred:
            s.offload = DeferredOffload()
            for h in stores[1:]:
                h.fill_(float("nan"))  # what a step would read before its copy
        got, _, _ = feed(s)
        assert all(a is b for a, b in zip(s.host, stores))
        runs.append((s, got))
    (sync, want), (late, got) = runs
    assert late.offload.deferred == L - 1 and late.offload.waiting is None
    for a, b in zip(sync.host[1:], late.host[1:]):
        assert torch.equal(a, b)
    assert_outputs(got, want)


def test_retroinfer_indexes_a_layer_behind_it_with_its_host_copy():
    """RetroInfer-style's hash index, as CLO's, is built by the layer's offload (on CUDA its own stream, while the
    next layer computes), from the staged rows, not on the compute stream inside the layer's prefill."""
    s = RetroInfer(sink=SINK, recent=RECENT, topk_ratio=RATIO, dense_layers=1, cpu_threads=2)
    s.allocate(replace(spec(), prompt_len=T0))
    s.offload = DeferredOffload()
    k = torch.randn(B, HKV, T0, D)
    s.prefill(1, k, torch.randn_like(k))
    assert s.retriever.codes[1] is None and s.offload.waiting is not None
    s.offload.finish()
    assert s.retriever.codes[1] is not None and s.retriever.codes[1].shape[2] == T0 - SINK - RECENT


def test_infinigen_gather_threads_follow_the_fetch_size():
    # the gather is memory-bound: half the cores stepped fastest for small fetches and at BSZ 1, every core for the
    # larger fetches of BSZ > 1 and for BSZ 1's largest
    big = ALL_CORES_FETCH_BYTES + 1
    assert gather_threads(16, ALL_CORES_FETCH_BYTES, 8) == 8 and gather_threads(16, big, 2) == 16
    assert gather_threads(16, ALL_CORES_FETCH_BYTES_BSZ1, 1) == 8
    assert gather_threads(16, ALL_CORES_FETCH_BYTES_BSZ1 + 1, 1) == 16
    assert gather_threads(1, 1, 1) == 1
    ig = InfiniGen(cpu_threads=1)
    assert ig.cpu_threads == 1 and not ig.auto_threads  # an explicit count is kept
