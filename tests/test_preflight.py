"""The memory preflight's ways out: they depend on the system, the device and what would fit by the same
estimate (bfloat16 instead of float32, the longest prompt, the largest batch)."""

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from experiments.runner import preflight
from kvoffload.errors import ConfigError
from kvoffload.kv.interface import GB, KVSpec
from kvoffload.model.config import ModelConfig

CONF = Path(__file__).resolve().parent.parent / "conf"
CPU = torch.device("cpu")


def setup(model: str, system: str, seqlen: int, batch: int = 1, dtype=torch.float32, gen: int = 24, *extra: str):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"model={model}", f"system={system}", *extra])
    mc = ModelConfig.from_mapping(cfg.model)
    spec = KVSpec(
        mc.num_layers, batch, seqlen + gen, mc.num_heads, mc.num_kv_heads, mc.head_dim, dtype, CPU, prompt_len=seqlen
    )

    def estimate(s: KVSpec) -> preflight.MemoryPlan:
        return preflight.plan_memory(mc, instantiate(cfg.system), s, s.prompt_tokens)

    return mc, spec, estimate


def refusal(monkeypatch, host_gb, model, system, seqlen, batch=1, dtype=torch.float32, gpu_mem_gb=None, *extra):
    monkeypatch.setattr(preflight, "host_available_bytes", lambda: int(host_gb * GB))
    mc, spec, estimate = setup(model, system, seqlen, batch, dtype, 24, *extra)
    with pytest.raises(ConfigError) as e:
        preflight.check_memory(estimate(spec), CPU, gpu_mem_gb, "this run", estimate, spec, mc.name)
    return str(e.value), spec, estimate


def fits(estimate, spec, host_gb, gpu_mem_gb=None) -> bool:
    limits = preflight.Limits(CPU, int(host_gb * GB), None if gpu_mem_gb is None else int(gpu_mem_gb * GB))
    return preflight.shortfall(estimate(spec), limits) is None


def test_cpu_fullattn_float32_is_told_bfloat16_fits(monkeypatch):
    """llama3 at 32K in float32 needs ~41 GB; in bfloat16 ~21 GB, which a 24 GB host has."""
    err, spec, estimate = refusal(monkeypatch, 24, "llama3", "fullattn", 32768)
    bf16 = estimate(replace(spec, dtype=torch.bfloat16))
    assert f"Ways out that fit by this estimate: dtype=bfloat16 (about {bf16.device_total / GB:.1f} GB)" in err
    assert fits(estimate, replace(spec, dtype=torch.bfloat16), 24)
    assert "offloading" not in err  # RAM is what is short: offloading the KV to RAM does not help
    assert "model=smollm2" in err and "a machine with more RAM" in err


def test_bfloat16_is_not_suggested_when_it_would_not_fit_alone(monkeypatch):
    err, spec, estimate = refusal(monkeypatch, 24, "llama3", "clo", 131072)
    assert "dtype=bfloat16 (" not in err
    m = re.search(r"dtype=bfloat16 with seqlen=(\d+)k or shorter", err)
    assert m, err  # neither alone, but bfloat16 with a shorter prompt fits
    bf16 = replace(spec, dtype=torch.bfloat16)
    n = int(m.group(1)) * 1024
    assert fits(estimate, replace(bf16, prompt_len=n, max_len=n + 24), 24)
    assert not fits(estimate, replace(bf16, prompt_len=n + 1024, max_len=n + 1024 + 24), 24)


def test_already_bfloat16_no_dtype_suggestion_and_the_longest_prompt_that_fits(monkeypatch):
    err, spec, estimate = refusal(monkeypatch, 24, "llama3", "fullattn", 131072, 1, torch.bfloat16)
    assert "dtype=" not in err
    n = int(re.search(r"seqlen=(\d+)k or shorter", err).group(1)) * 1024
    assert fits(estimate, replace(spec, prompt_len=n, max_len=n + 24), 24)
    assert not fits(estimate, replace(spec, prompt_len=n + 1024, max_len=n + 1024 + 24), 24)


def test_the_largest_batch_that_fits(monkeypatch):
    err, spec, estimate = refusal(monkeypatch, 4, "smollm2", "fullattn", 8000, 64, torch.bfloat16)
    b = int(re.search(r"batch=(\d+)", err).group(1))
    assert (
        1 <= b < 64 and fits(estimate, replace(spec, batch=b), 4) and not fits(estimate, replace(spec, batch=b + 1), 4)
    )
    assert "model=smollm2" not in err  # already the small model


@pytest.mark.parametrize("system,offload", [("fullattn", True), ("clo", False), ("retroinfer", False)])
def test_an_offloading_system_is_suggested_only_to_fullattn_when_device_memory_is_short(monkeypatch, system, offload):
    err, *_ = refusal(
        monkeypatch,
        1000,
        "llama3",
        system,
        131072,
        1,
        torch.bfloat16,
        20.0,
        "model.reuse_profile=data/profiles/llama3-from-smollm2.json",
    )
    assert "GPU memory" in err and "a larger hardware.gpu_mem_gb" in err and "more RAM" not in err
    assert ("offloading system" in err) is offload
    assert "instead of fullattn" not in err


def test_a_run_that_fits_is_not_refused(monkeypatch):
    monkeypatch.setattr(preflight, "host_available_bytes", lambda: 100 * GB)
    mc, spec, estimate = setup("smollm2", "fullattn", 1024)
    assert preflight.check_memory(estimate(spec), CPU, None, "this run", estimate, spec, mc.name) is None
    budget = preflight.check_memory(estimate(spec), CPU, 8.0, "this run", estimate, spec, mc.name)
    plan = estimate(spec)
    assert budget == int(8 * GB) - plan.weights - plan.activations


def test_largest():
    assert preflight.largest(lambda n: n <= 37, 1, 100) == 37
    assert preflight.largest(lambda n: n <= 37, 1, 10) == 10
    assert preflight.largest(lambda n: False, 1, 100) is None
    assert preflight.largest(lambda n: True, 1, 0) is None


def test_a_host_short_of_the_pinned_stores_is_refused_saying_so():
    """torch pins in powers of two: a plan whose stores fit the host's RAM as bytes but not as pinned blocks."""
    from experiments.runner.preflight import Limits, MemoryPlan, shortfall

    plan = MemoryPlan(weights=GB, activations=GB, kv_device=GB, kv_host=60 * GB, kv_host_pinned=64 * GB)
    limits = Limits(torch.device("cuda"), host=62 * GB, budget=None)
    short, why = shortfall(plan, limits)
    assert short == "host" and "pinned as 64.0" in why and "62.0 GB is available" in why
    assert shortfall(replace(plan, kv_host_pinned=60 * GB), limits) is None


SYSTEM_NAMES = sorted(p.stem for p in (CONF / "system").glob("*.yaml"))


@pytest.mark.parametrize("system", SYSTEM_NAMES)
def test_the_unmeasured_plan_holds_each_systems_least_stores(system):
    """check_before_measuring plans with preflight.UNMEASURED in place of the link, a layer's time and the budget:
    that holds only while no system's host stores depend on the first two and a budget of 0 gives its least host
    stores, and while a plan without host stores has one device share whatever was measured."""
    mc, spec, estimate = setup("llama3", system, 32768, 4, torch.bfloat16)
    cuda = replace(spec, device=torch.device("cuda"))
    least = estimate(replace(cuda, **preflight.UNMEASURED))
    for link, layer_s in ((55.0, 2e-4), (5.0, 5e-2)):
        same = estimate(replace(cuda, **(preflight.UNMEASURED | {"link_gb_s": link, "layer_time_s": layer_s})))
        assert (same.kv_host, same.kv_host_pinned) == (least.kv_host, least.kv_host_pinned)
        for budget in (None, 2 * GB, 8 * GB):
            p = estimate(replace(cuda, link_gb_s=link, layer_time_s=layer_s, gpu_budget_bytes=budget))
            assert p.kv_host_pinned >= least.kv_host_pinned, (budget, p.kv_host_pinned, least.kv_host_pinned)
            assert least.kv_host > 0 or p.device_total == least.device_total, (budget, p.device_total)
    assert least.kv_host > 0 or system == "fullattn"


def before_measuring(monkeypatch, system: str, seqlen: int, batch: int, gpu_mem_gb: float | None, *extra: str):
    """preflight.check_before_measuring for a CUDA run of Llama-3 shapes on a host with 100 GB of RAM (a CPU run
    with extra "cpu"); the device's memory is never queried (its function fails the test)."""
    monkeypatch.setattr(preflight, "host_available_bytes", lambda: 100 * GB)
    monkeypatch.setattr(preflight, "device_memory", lambda device: pytest.fail("the device was queried"))
    device = "cpu" if "cpu" in extra else "cuda"
    overrides = [x for x in extra if x != "cpu"]
    mc, spec, estimate = setup("llama3", system, seqlen, batch, torch.bfloat16, 24, *overrides)
    with initialize_config_dir(str(CONF), version_base="1.3"):
        built = instantiate(compose("config", overrides=["model=llama3", f"system={system}", *overrides]).system)
    run = replace(spec, device=torch.device(device), **preflight.UNMEASURED)
    preflight.check_before_measuring(mc, built, run, None, "prefill", "this run", estimate, gpu_mem_gb)


def test_a_run_beyond_the_hosts_ram_is_refused_before_any_measurement(monkeypatch):
    """A CUDA run whose pinned stores the host cannot hold is refused from the unmeasured plan, with the batch that
    fits the host; a CPU run is left to the full check (its RAM also holds the device's share)."""
    with pytest.raises(ConfigError) as e:
        before_measuring(monkeypatch, "clo", 131072, 8, None)
    assert re.match(r"this run needs about \S+ GB of RAM on this host .* 100\.0 GB is available", str(e.value))
    # BSZ 6's 30 stores of 3 GiB, five to a 16 GiB pinned block (kvoffload/offload/host.py, store_packs), pin
    # 96 GiB; one store a block would pin 4 GiB each, 120 GiB
    assert "batch=6 or smaller" in str(e.value) and "a machine with more RAM" in str(e.value)
    before_measuring(monkeypatch, "clo", 131072, 6, None)
    before_measuring(monkeypatch, "clo", 131072, 8, None, "cpu")  # CPU: not checked here


def test_a_run_beyond_the_budget_is_refused_before_any_measurement(monkeypatch):
    """FullAttn's KV beyond hardware.gpu_mem_gb is refused from the unmeasured plan, without querying the device,
    with the largest batch the budget holds. An offloading system's budget waits for the measurements (its least
    device share is not always the unmeasured plan's: CLO at top-k 1.0), and a budget below the weights for
    kv_budget's message (the weights alone)."""
    with pytest.raises(ConfigError) as e:
        before_measuring(monkeypatch, "fullattn", 32768, 8, 48)
    msg = str(e.value)
    assert re.match(r"this run needs about \S+ GB of GPU memory .* but the budget is 48\.0 GB \(hardware", msg)
    largest = int(re.search(r"batch=(\d+) or smaller", msg).group(1))
    assert "an offloading system" in msg and "a larger hardware.gpu_mem_gb" in msg
    before_measuring(monkeypatch, "fullattn", 32768, largest, 48)
    with pytest.raises(ConfigError):
        before_measuring(monkeypatch, "fullattn", 32768, largest + 1, 48)
    before_measuring(monkeypatch, "clo", 32768, 8, 48)
    before_measuring(monkeypatch, "clo", 32768, 4, 16, "system.topk_ratio=1.0")  # its KV beyond 16 GB: not here
    before_measuring(monkeypatch, "fullattn", 32768, 8, 10)  # below the weights (15 GB): not this check's refusal
