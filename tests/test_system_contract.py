"""The contract every KV system keeps, for every yaml in conf/system/ (a new system's yaml is picked up by itself):
it is built from its yaml by Hydra, estimates its memory from shapes alone, and then holds exactly that after
allocation and prefill; it decodes on the CPU; what it reports holding is its real buffers."""

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from kvoffload.kv.interface import KVOffloadSystem, KVSpec
from kvoffload.kv.timer import PhaseTimer
from kvoffload.paths import ROOT

SYSTEMS = sorted(p.stem for p in (ROOT / "conf" / "system").glob("*.yaml"))
T0, STEPS = 700, 3


def build(name: str) -> tuple[KVOffloadSystem, KVSpec]:
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=[f"system={name}"])  # SmolLM2's shapes, and its profiles
    m = cfg.model
    spec = KVSpec(
        m.num_layers,
        2,
        T0 + STEPS,
        m.num_heads,
        m.num_kv_heads,
        m.head_dim,
        torch.float32,
        torch.device("cpu"),
        prompt_len=T0,
    )
    return instantiate(cfg.system), spec


def test_every_system_has_a_yaml_and_a_class():
    assert {"fullattn", "clo", "retroinfer", "infinigen"} <= set(SYSTEMS)
    for name in SYSTEMS:
        system, _ = build(name)
        assert isinstance(system, KVOffloadSystem) and system.name == name


@pytest.mark.parametrize("name", SYSTEMS)
def test_estimate_equals_what_is_allocated_and_decode_runs(name):
    system, spec = build(name)
    estimate = system.estimate_parts(spec)
    assert system.estimate_memory(spec).device_bytes == sum(v for k, v in estimate.items() if not k.startswith("host"))
    system.allocate(spec, PhaseTimer(spec.device, enabled=False))
    g = torch.Generator().manual_seed(0)
    shape = (spec.batch, spec.num_kv_heads, T0, spec.head_dim)
    with torch.inference_mode():
        for layer in range(spec.num_layers):
            system.prefill(layer, torch.randn(shape, generator=g), torch.randn(shape, generator=g))
        system.end_prefill(T0)
        assert system.memory_parts() == estimate
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
    held = system.memory_held()
    assert held.device_bytes + held.host_bytes == sum(system.memory_parts().values())
    assert isinstance(system.describe(), dict)
