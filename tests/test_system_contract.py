"""The contract every KV system keeps, for every yaml in conf/system/ (a new system's yaml is picked up by itself):
it is built from its yaml by Hydra, estimates its memory from shapes alone, and then holds exactly that after
allocation and prefill; it decodes on the CPU; what it reports holding is its real buffers."""

from dataclasses import replace

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from kvoffload.errors import ConfigError
from kvoffload.kv.interface import KVOffloadSystem, KVSpec
from kvoffload.kv.timer import PhaseTimer
from kvoffload.model.config import ModelConfig
from kvoffload.model.rope import rope_frequencies
from kvoffload.paths import ROOT

SYSTEMS = sorted(p.stem for p in (ROOT / "conf" / "system").glob("*.yaml"))
T0, STEPS = 700, 3


def build(name: str, t0: int = T0) -> tuple[KVOffloadSystem, KVSpec]:
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=[f"system={name}"])  # SmolLM2's shapes, and its profiles
    m = cfg.model
    spec = KVSpec(
        m.num_layers,
        2,
        t0 + STEPS,
        m.num_heads,
        m.num_kv_heads,
        m.head_dim,
        torch.float32,
        torch.device("cpu"),
        prompt_len=t0,
        rope_inv_freq=rope_frequencies(ModelConfig.from_mapping(OmegaConf.to_container(m, resolve=True))),
    )
    return instantiate(cfg.system), spec


def test_the_paper_systems_are_configured():
    assert {"fullattn", "clo", "retroinfer", "infinigen", "pqcache", "shadowkv"} <= set(SYSTEMS)


@pytest.mark.parametrize("name", SYSTEMS)
def test_a_system_yaml_names_its_class(name):
    """conf/system/<name>.yaml instantiates a KVOffloadSystem whose `name` is <name>: records and plots know a
    system by it."""
    system, _ = build(name)
    assert isinstance(system, KVOffloadSystem) and system.name == name


def prefill_random(system: KVOffloadSystem, spec: KVSpec) -> torch.Generator:
    g = torch.Generator().manual_seed(0)
    shape = (spec.batch, spec.num_kv_heads, spec.prompt_tokens, spec.head_dim)
    with torch.inference_mode():
        for layer in range(spec.num_layers):
            system.prefill(layer, torch.randn(shape, generator=g), torch.randn(shape, generator=g))
        system.end_prefill(spec.prompt_tokens)
    return g


# systems that plan inside a device budget (CLO demotes persistent heads, RetroInfer shrinks its block cache);
# the others hold what their shapes need or refuse
PLAN_UNDER_BUDGET = {"clo", "retroinfer"}


@pytest.mark.slow
@pytest.mark.parametrize("name", SYSTEMS)
def test_under_a_budget_the_estimate_obeys_it_and_equals_what_is_allocated(name):
    system, spec = build(name, t0=2000)  # top-k 10 % reaches beyond sink + recent: a block cache exists
    spec = replace(spec, layer_time_s=1e-9)  # Eq. 12's N_p = 0: CLO's hard heads are all persistent
    unbudgeted = system.estimate_memory(spec).device_bytes
    spec = replace(spec, gpu_budget_bytes=unbudgeted - 1)  # one byte short: the smallest cut in the plan
    system, _ = build(name, t0=2000)
    if name not in PLAN_UNDER_BUDGET:
        with pytest.raises(ConfigError, match="budget"):
            system.allocate(spec, PhaseTimer(spec.device, enabled=False))
        return
    estimate = system.estimate_parts(spec)
    assert system.estimate_memory(spec).device_bytes <= spec.gpu_budget_bytes < unbudgeted
    system.allocate(spec, PhaseTimer(spec.device, enabled=False))
    prefill_random(system, spec)
    assert system.memory_parts() == estimate


# 50: no longer than sink + recent, so no middle at all; T0 (a middle to select from) takes seconds: the full suite
@pytest.mark.parametrize("t0", [pytest.param(T0, marks=pytest.mark.slow), 50])
@pytest.mark.parametrize("name", SYSTEMS)
def test_estimate_equals_what_is_allocated_and_decode_runs(name, t0):
    system, spec = build(name, t0)
    estimate = system.estimate_parts(spec)
    assert system.estimate_memory(spec).device_bytes == sum(v for k, v in estimate.items() if not k.startswith("host"))
    system.allocate(spec, PhaseTimer(spec.device, enabled=False))
    g = prefill_random(system, spec)
    assert system.memory_parts() == estimate
    with torch.inference_mode():
        for _ in range(STEPS):
            system.begin_step()
            for layer in range(spec.num_layers):
                q = torch.randn(spec.batch, spec.num_heads, spec.head_dim, generator=g)
                if system.wants_speculative_query and layer + 1 < spec.num_layers:
                    system.prepare(layer + 1, q)
                k, v = (torch.randn(spec.batch, spec.num_kv_heads, spec.head_dim, generator=g) for _ in "kv")
                out = system.decode(layer, q, k, v)
                assert out.shape == q.shape and torch.isfinite(out).all()
            stats = system.end_step()
            assert 0 <= stats.hits <= stats.lookups
            if name == "clo":  # every prefetch head of every sequence is refreshed each step, with no lookup
                plan = system.describe()["plan"]
                assert stats.refreshes == spec.batch * plan["prefetch_heads"]
            else:
                assert stats.refreshes == 0
    held = system.memory_held()
    assert held.device_bytes + held.host_bytes == sum(system.memory_parts().values())
    assert isinstance(system.describe(), dict)


def test_host_stores_share_pinned_blocks_where_their_size_is_no_power_of_two():
    """Torch pins powers of two: 30 stores of 3 GiB (768K tokens of Llama-3-8B) pinned one a block take 120 GiB,
    packed five to a 16 GiB block 96. Each store is a contiguous view of its own memory; a list made before the
    prompt's length was known is filled, packed, at the first sparse layer's prefill, and a prefill of another
    length than the one pinned for is refused."""
    from kvoffload.offload import host

    gib = 2**30
    assert host.store_packs(3 * gib, 30) == [5] * 6
    assert host.store_packs(int(2.5 * gib), 30) == [6] * 5  # 80 GiB, not 120
    assert host.store_packs(17 * gib, 2) == [1, 1]  # above PACK_BYTES: a block each
    assert host.store_packs(2 * gib, 3) == [1, 1, 1]  # a power of two: nothing to save
    for store, n in ((3 * gib, 30), (96 * 2**20, 30), (5, 7), (1000, 1), (3 * gib, 0)):
        packs = host.store_packs(store, n)
        blocks = [host.pinned_bytes(m * store) for m in packs]
        assert sum(packs) == n and max(blocks, default=0) <= max(host.PACK_BYTES, host.pinned_bytes(store))
        assert sum(blocks) <= n * host.pinned_bytes(store)
    spec = KVSpec(6, 3, 103, 9, 3, 64, torch.float32, torch.device("cpu"), prompt_len=100)
    stores = host.host_stores(spec, 2, 100)
    assert stores[:2] == [None, None] and len(stores) == 6
    assert all(s.shape == (3, 3, 100, 2, 64) and s.is_contiguous() for s in stores[2:])
    for i, s in enumerate(stores[2:]):
        s.fill_(i)
    assert [s.unique().tolist() for s in stores[2:]] == [[0.0], [1.0], [2.0], [3.0]]
    late = host.host_stores(spec, 2, None)
    assert late == [None] * 6
    assert host.layer_store(late, 2, spec, 2, 100).shape == (3, 3, 100, 2, 64) and late[5] is not None
    with pytest.raises(RuntimeError, match="holds 100 rows a head but its prefill offloads 90"):
        host.layer_store(late, 3, spec, 2, 90)


@pytest.mark.parametrize("name", SYSTEMS)
def test_the_pinned_host_estimate_counts_each_store_in_torchs_block_sizes(name, monkeypatch):
    """On CUDA the host stores are pinned, and torch's pinned allocator hands out powers of two: what the preflight
    counts of the host's RAM is each store allocated (kvoffload/offload/host.py) rounded so, beside the rest."""
    from kvoffload.offload import host

    sizes, real = [], host.host_buffer

    def recording(shape, dtype, pinned, what="a layer's"):
        t = real(shape, dtype, pinned, what)
        sizes.append(t.nbytes)
        return t

    monkeypatch.setattr(host, "host_buffer", recording)
    system, spec = build(name, t0=1000)
    logical, pinned = system.estimate_memory(spec).host_bytes, system.pinned_host_bytes(spec)
    system.allocate(spec, PhaseTimer(spec.device, enabled=False))
    assert pinned == logical - sum(sizes) + sum(host.pinned_bytes(n) for n in sizes)
    assert (pinned > logical) == bool(sizes)  # SmolLM2's 3 KV heads: no store is a power of two
