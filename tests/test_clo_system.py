"""CLO's invariants through the KVOffloadSystem API (CPU reference path): forced misses with the exact
retriever equal exact top-k attention recomputed from scratch; top-k 100% equals FullAttn; statistics and
memory match an independent count; a hit leaves the slot alone; bad input is refused."""

import math

import pytest
import torch

from baselines.fullattn import FullAttn
from clo.system import CLO
from kvoffload.errors import ConfigError
from kvoffload.kv.interface import KVSpec
from tests.reference import exact_topk_attention, first_head_hard, write_profile

B, H, HKV, D, L, T0, STEPS = 2, 8, 2, 16, 3, 120, 5
G = H // HKV
CPU = torch.device("cpu")


def spec(budget=None):
    return KVSpec(L, B, T0 + STEPS, H, HKV, D, torch.float32, CPU, budget)


BASE = dict(retriever="exact", speculative=False, persistent=False, dense_layers=0, sink=4, recent=8, topk_ratio=0.25)


def make(**kw) -> CLO:
    return make_with(kw)


def make_with(kw: dict, budget: int | None = None) -> CLO:
    s = CLO(**{**BASE, **kw})
    s.allocate(spec(budget))
    return s


def feed(systems, seed=0, steps=STEPS, speculative=False):
    """Same random prompt and decode inputs into every system; returns per-step outputs of each, and the data
    (per step and layer (q, k_new, v_new), and with `speculative` a 4th, the query given one layer ahead to
    prepare(), independent of q)."""
    g = torch.Generator().manual_seed(seed)
    k0, v0 = torch.randn(L, B, HKV, T0, D, generator=g), torch.randn(L, B, HKV, T0, D, generator=g)
    for s in systems:
        for layer in range(L):
            s.prefill(layer, k0[layer], v0[layer])
        s.end_prefill(T0)
    outs, data = [[] for _ in systems], []
    for _ in range(steps):
        step = [
            (
                torch.randn(B, H, D, generator=g),
                torch.randn(B, HKV, D, generator=g),
                torch.randn(B, HKV, D, generator=g),
            )
            + ((torch.randn(B, H, D, generator=g),) if speculative else ())
            for _ in range(L)
        ]
        data.append(step)
        for s, o in zip(systems, outs):
            s.begin_step()
            row = []
            for layer in range(L):
                if speculative and layer + 1 < L:
                    s.prepare(layer + 1, step[layer + 1][3])
                row.append(s.decode(layer, *step[layer][:3]))
            o.append(row)
            s.end_step()
    return outs, (k0, v0, data)


def test_forced_misses_with_exact_retriever_equal_exact_topk_attention():
    clo = make(threshold_override=2.0)
    (got,), (k0, v0, data) = feed([clo])
    k_sel = math.ceil(0.25 * T0) - 4 - 8
    want = exact_topk_attention(k0, v0, data, 4, 8, k_sel)
    for s in range(STEPS):
        for layer in range(L):
            torch.testing.assert_close(got[s][layer], want[s][layer], atol=1e-5, rtol=1e-4)
    assert clo.step.hits == 0 and clo.step.lookups == L * B * HKV


def test_topk_100_percent_equals_fullattn():
    clo = make(topk_ratio=1.0, threshold_override=-2.0, retriever="hash")
    full = FullAttn()
    full.allocate(spec())
    (a, b), _ = feed([clo, full])
    for s in range(STEPS):
        for layer in range(L):
            torch.testing.assert_close(a[s][layer], b[s][layer], atol=1e-5, rtol=1e-4)


def device_bytes_held(clo: CLO) -> int:
    """An independent count: the bytes of every device tensor the stores and the retriever hold."""
    tensors = [
        t
        for st in clo.stores
        for t in (st.slots, st.slot_idx, st.labels, st.valid, st.window, st.persist)
        if t is not None
    ]
    return sum(t.nbytes for t in tensors) + sum(k.nbytes for k in clo.retriever.keys)


def test_statistics_and_memory_match_an_independent_count():
    clo = make(threshold_override=None, eta=0.3, adaptive_threshold=False)
    clo.trace = []
    per_step = []
    g = torch.Generator().manual_seed(5)
    k0, v0 = torch.randn(L, B, HKV, T0, D, generator=g), torch.randn(L, B, HKV, T0, D, generator=g)
    for layer in range(L):
        clo.prefill(layer, k0[layer], v0[layer])
    clo.end_prefill(T0)
    base = torch.randn(L, B, H, D, generator=g)
    for _ in range(STEPS):  # slowly drifting queries: a mix of hits and misses
        clo.begin_step()
        start = len(clo.trace)
        for layer in range(L):
            q = base[layer] + 0.8 * torch.randn(B, H, D, generator=g)
            clo.decode(layer, q, torch.randn(B, HKV, D, generator=g), torch.randn(B, HKV, D, generator=g))
        stats = clo.end_step()
        # the floor's metadata bytes: step_device_bytes less what floor_rest counts independently
        per_step.append((stats, clo.trace[start:], clo.scored_rows, clo.step_device_bytes() - floor_rest(clo)))
    k_sel = clo.stores[0].k
    total_hits = 0
    per_row = clo.retriever.metadata_bytes() // (L * B * HKV)
    for stats, trace, scored_rows, metadata in per_step:
        misses = sum(int(m.sum()) for _, m in trace)
        lookups = sum(m.numel() for _, m in trace)
        assert stats.lookups == lookups and stats.hits == lookups - misses
        assert stats.bytes_h2d == misses * k_sel * 2 * D * 4
        # its floor reads the metadata of the rows it scored: the missed heads' (no persistent heads here)
        assert scored_rows == misses and metadata == misses * per_row
        total_hits += stats.hits
    assert 0 < total_hits < STEPS * L * B * HKV  # the trace really mixes hits and misses
    held = clo.memory_held()
    assert held.device_bytes == device_bytes_held(clo)
    assert held.host_bytes == sum(st.host.nbytes for st in clo.stores) == L * B * HKV * T0 * 2 * D * 4
    assert clo.estimate_memory(spec()).host_bytes >= held.host_bytes


def floor_rest(clo) -> int:
    """step_device_bytes without the metadata, counted independently: every head's window (sink, recent,
    generated) and selected rows, and the labels (dense_layers=0: no dense layer)."""
    gen = clo.length - T0 + 1
    st = clo.stores[0]
    return L * (B * HKV * (st.sink + st.recent + gen + st.k) * 2 * D * 4 + st.labels.nbytes)


def test_memory_counts_a_persistent_head_once(tmp_path):
    """A persistent head keeps its full KV on the device, counted under 'persistent', and has no slots; the
    held bytes are still the sum of the store's tensors."""
    profile = write_profile(tmp_path / "first_head_hard.json", first_head_hard(L, HKV))
    clo = make(persistent=True, profile=profile, layer_time_ms=0.1, link_gb_s=1e-3)
    feed([clo], steps=1)
    assert all(st.nc == HKV - 1 and st.slots.shape[1] == st.nc and st.persist.shape[1] == 1 for st in clo.stores)
    assert clo.memory_parts()["persistent"] == sum(st.persist.nbytes for st in clo.stores) == L * B * T0 * 2 * D * 4
    assert clo.memory_held().device_bytes == device_bytes_held(clo)


@pytest.mark.parametrize("persist_query", ["real", "speculative"])
def test_persistent_heads_select_with_the_configured_query(tmp_path, persist_query):
    """Head 0 persistent, head 1 cached (forced misses, exact retriever), queries given one layer ahead: the cached
    head's top-k comes from the speculative query, the persistent head's from the real query or, with
    persist_query=speculative, from the speculative one too. Layer 0 has no layer before it: the real query."""
    profile = write_profile(tmp_path / "first_head_hard.json", first_head_hard(L, HKV))
    # tau = 2 everywhere (every lookup misses); epsilon = -2 keeps head 1 easy under it (Eq. 11)
    clo = make(
        persistent=True,
        speculative=True,
        persist_query=persist_query,
        threshold_override=2.0,
        epsilon=-2.0,
        profile=profile,
        layer_time_ms=0.1,
        link_gb_s=1e-3,
    )
    (got,), (k0, v0, data) = feed([clo], seed=7, speculative=True)
    assert all(st.persist is not None and st.nc == HKV - 1 for st in clo.stores)
    select = []
    for step in data:
        sel = [step[0][0]]
        for layer in range(1, L):
            q_sel = step[layer][3].clone()
            if persist_query == "real":
                q_sel[:, :G] = step[layer][0][:, :G]  # KV head 0's query group
            sel.append(q_sel)
        select.append(sel)
    want = exact_topk_attention(k0, v0, data, 4, 8, clo.stores[0].k, select=select)
    for s in range(STEPS):
        for layer in range(L):
            torch.testing.assert_close(got[s][layer], want[s][layer], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(retriever="hash"),
        dict(retriever="pq"),
        dict(persistent=True, speculative=True),
        dict(dense_layers=1, retriever="hash", persistent=True, speculative=True),
    ],
)
def test_memory_estimate_is_what_allocate_and_prefill_hold(tmp_path, kw):
    """From the shapes alone, with the prompt length given, the estimate is the memory the stores hold after the
    prefill and the steps, part by part (the generated tokens' window rows included); without it, the prompt is
    taken to be max_len."""
    if kw.get("persistent"):
        kw["profile"] = write_profile(tmp_path / "first_head_hard.json", first_head_hard(L, HKV))
        kw.update(layer_time_ms=0.1, link_gb_s=1e-3)
    clo = make(**kw)
    feed([clo], steps=2)
    assert clo.estimate_parts(KVSpec(**{**spec().__dict__, "prompt_len": T0})) == clo.memory_parts()
    assert clo.estimate_parts(spec())["host"] == clo.memory_parts()["host"] * (T0 + STEPS) // T0


def test_a_hit_keeps_slot_and_label():
    clo = make(threshold_override=-2.0)  # every lookup after the first fill hits
    g = torch.Generator().manual_seed(3)
    feed([clo], steps=1)
    st = clo.stores[1]
    slots, labels, idx = st.slots.clone(), st.labels.clone(), st.slot_idx.clone()
    clo.begin_step()
    for layer in range(L):
        clo.decode(layer, torch.randn(B, H, D, generator=g), torch.randn(B, HKV, D), torch.randn(B, HKV, D))
    stats = clo.end_step()
    assert stats.hits == stats.lookups == L * B * HKV and stats.bytes_h2d == 0
    assert torch.equal(st.slots, slots) and torch.equal(st.labels, labels) and torch.equal(st.slot_idx, idx)


def test_speculative_prepare_drives_the_lookup():
    clo = make(speculative=True, threshold_override=2.0)
    feed([clo], steps=1)
    clo.trace = []
    clo.begin_step()
    q = torch.randn(B, H, D)
    clo.prepare(1, q)
    assert [layer for layer, _ in clo.trace] == [1]
    clo.decode(1, q, torch.randn(B, HKV, D), torch.randn(B, HKV, D))
    assert [layer for layer, _ in clo.trace] == [1]  # decode did not look up again
    clo.end_step()


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(topk_ratio=1.5), "top-k"),
        (dict(topk_ratio=0.0), "top-k"),
        (dict(eta=1.2), "eta"),
        (dict(eta=-1.0), "eta"),
        (dict(gqa_aggregation="max"), "gqa_aggregation"),
        (dict(retriever="lsh"), "retriever"),
        (dict(transfer="dma"), "transfer"),
        (dict(cpu_threads=0), "cpu_threads"),
        (dict(topk="heap"), "topk"),
        (dict(uva_programs=0), "uva_programs"),
        (dict(persist_query="next"), "persist_query"),
        (dict(persist_query="speculative", speculative=False), "persist_query"),
        (dict(threshold_override=5.0), "threshold_override"),
        (dict(n=0.0), "n=0.0"),
        (dict(rbit=12), "rbit"),
        (dict(epsilon=3.0), "epsilon"),
        (dict(layer_time_ms=0.0), "layer_time_ms"),
        (dict(link_gb_s=-1.0), "link_gb_s"),
        (dict(retreiver="hash"), "retreiver"),
    ],
)
def test_bad_configuration(kw, match):
    with pytest.raises(ConfigError, match=match):
        CLO(**kw)


def test_importance_shape_mismatch_and_small_budget():
    with pytest.raises(ConfigError, match="shape"):
        CLO(importance="Llama-3-8B-Instruct-Gradient-1048k").allocate(spec())
    s = CLO(persistent=False)
    need = s.estimate_memory(spec()).device_bytes
    with pytest.raises(ConfigError, match="budget"):
        CLO(persistent=False).allocate(spec(budget=need // 2))


def test_the_estimate_and_the_allocation_share_one_plan(monkeypatch, tmp_path):
    """The planner runs once for a spec: the allocation reads the plan the estimate made."""
    import clo.system

    calls = []
    real = clo.system.make_plan
    monkeypatch.setattr(clo.system, "make_plan", lambda *a: calls.append(a) or real(*a))
    s = CLO(
        **{
            **BASE,
            "profile": write_profile(tmp_path / "p.json", first_head_hard(L, HKV)),
            "persistent": True,
            "speculative": True,
            "layer_time_ms": 0.1,
            "link_gb_s": 1e-3,
        }
    )
    s.estimate_memory(spec(budget=10**9))
    planned = s.plan
    s.allocate(spec(budget=10**9))
    assert len(calls) == 1 and s.plan is planned and sum(map(len, planned.heads.persistent)) > 0


def planned_heads(tmp_path, s_hat) -> dict:
    """CLO settings that plan from this difficulty profile: its hard heads persistent, a slow link, short layers."""
    profile = write_profile(tmp_path / "p.json", s_hat)
    return dict(profile=profile, persistent=True, speculative=True, layer_time_ms=0.1, link_gb_s=1e-3)


def test_a_tight_budget_demotes_the_least_hard_persistent_heads(tmp_path):
    """Under a device budget the persistent heads that do not fit take the cached path, the least hard first; the
    estimate then fits the budget and is what the system holds."""
    s_hat = first_head_hard(L, HKV)
    for row in s_hat:
        row[1] = 0.5  # head 1 hard too, less than head 0
    kw = planned_heads(tmp_path, s_hat)
    free = CLO(**{**BASE, **kw})
    need = free.estimate_memory(spec()).device_bytes
    assert all(set(p) == {0, 1} for p in free.plan.heads.persistent)
    one_head = B * T0 * 2 * D * 4  # a persistent head's prompt KV, per layer
    tight = make_with(kw, budget=need - one_head)  # room for all but about one layer's second persistent head
    demoted = tight.plan.heads.demoted
    assert sum(map(len, demoted)) >= 1 and all(h == 1 for d in demoted for h in d)  # the easier head goes first
    assert all(0 in p for p in tight.plan.heads.persistent)
    feed([tight], steps=2)
    held = tight.memory_held().device_bytes
    assert held <= need - one_head
    assert tight.estimate_parts(KVSpec(**{**spec(need - one_head).__dict__, "prompt_len": T0})) == tight.memory_parts()


def test_a_budget_no_demotion_meets_is_refused_with_clos_smallest_plan(tmp_path):
    """Where even every head demoted does not fit, the estimate (and so the refusal's numbers) is CLO's least: the plan
    with no persistent head, not the one it started from."""
    kw = planned_heads(tmp_path, first_head_hard(L, HKV))
    free = CLO(**{**BASE, **kw})
    need = free.estimate_memory(spec()).device_bytes
    assert sum(map(len, free.plan.heads.persistent)) > 0
    smallest = CLO(**{**BASE, **kw, "persistent": False}).estimate_memory(spec()).device_bytes
    assert smallest < need
    s = CLO(**{**BASE, **kw})
    assert s.estimate_memory(spec(smallest - 1)).device_bytes == smallest
    assert sum(map(len, s.plan.heads.persistent)) == 0
    with pytest.raises(ConfigError, match="budget"):
        s.allocate(spec(smallest - 1))
