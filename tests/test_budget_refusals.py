"""Device budgets that cannot be honoured are refused before anything is allocated: a budget above what
the device has, one that does not even hold the weights, and a batch or prompt that does not fit it, with the
estimate and the largest batch that would. The device is faked where the preflight reads it
(preflight.device_memory); execute.execute calls these checks before it loads a weight."""

import re
from dataclasses import replace

import pytest
import torch
from omegaconf import OmegaConf

from baselines.fullattn import FullAttn
from experiments.runner import preflight
from kvoffload.errors import ConfigError
from kvoffload.kv.interface import GB, KVSpec
from kvoffload.model.config import ModelConfig
from tests.test_preflight import CONF

CUDA = torch.device("cuda")  # never touched: device_memory is faked


def llama3() -> ModelConfig:
    return ModelConfig.from_mapping(OmegaConf.to_container(OmegaConf.load(CONF / "model" / "llama3.yaml")))


def spec(cfg: ModelConfig, seqlen: int, batch: int = 1, dtype=torch.bfloat16, device=CUDA) -> KVSpec:
    return KVSpec(
        cfg.num_layers,
        batch,
        seqlen + 16,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        dtype,
        device,
        prompt_len=seqlen,
        link_gb_s=50.0,
        layer_time_s=1e-3,
    )


@pytest.fixture
def device(monkeypatch):
    """A fake 48 GB card with 40 GB free, and a host with plenty of RAM."""
    monkeypatch.setattr(preflight, "device_memory", lambda dev: (40 * GB, 48 * GB))
    monkeypatch.setattr(preflight, "host_available_bytes", lambda: 1000 * GB)


@pytest.mark.parametrize("gb,has", [(60, "has (48.0 GB)"), (44, "has free (40.0 GB of 48.0)")])
def test_a_budget_above_the_devices_free_memory_is_refused_not_capped(device, gb, has):
    with pytest.raises(ConfigError) as e:
        preflight.kv_budget(llama3(), spec(llama3(), 4096), gb)
    msg = str(e.value)
    assert f"hardware.gpu_mem_gb={gb} is more than the GPU {has}" in msg
    assert "use at most 40" in msg and "\n" not in msg


def test_a_budget_within_the_free_memory_is_the_budget(device):
    cfg, s = llama3(), spec(llama3(), 4096)
    fixed = cfg.num_params * 2 + preflight.activation_bytes(cfg, 4096, 1, 2)
    assert preflight.kv_budget(cfg, s, 30) == int(30 * GB) - fixed
    assert preflight.kv_budget(cfg, s, None) == 40 * GB - fixed  # no budget set: what is free
    assert preflight.memory_limits(CUDA, 30).emulated and not preflight.memory_limits(CUDA, None).emulated


@pytest.mark.parametrize(
    "dtype,gb,bf16", [(torch.bfloat16, 12, False), (torch.float32, 20, True), (torch.float32, 12, False)]
)
def test_a_budget_below_the_weights_is_refused(device, dtype, gb, bf16):
    """llama3's weights: 15 GB in bfloat16, 30 in float32; bfloat16 is suggested only where it would hold them."""
    with pytest.raises(ConfigError) as e:
        preflight.kv_budget(llama3(), spec(llama3(), 4096, dtype=dtype), gb)
    msg = str(e.value)
    weights = f"{llama3().num_params * dtype.itemsize / GB:.1f}"
    assert f"the budget is {gb}.0 GB" in msg and f"less than llama3's weights alone ({weights} GB" in msg
    assert ("dtype=bfloat16" in msg) is bf16


def test_a_small_budget_is_named_as_given(device):
    """A budget under 1 GB keeps two significant digits: 0.01 must not read "0.0 GB"."""
    with pytest.raises(ConfigError, match=r"the budget is 0\.01 GB"):
        preflight.kv_budget(llama3(), spec(llama3(), 4096), 0.01)
    sizes = (0, 0.25 * GB, 0.997 * GB, 15 * GB, GB // 10**7)
    assert [preflight.gb(n) for n in sizes] == ["0.0", "0.25", "1.0", "15.0", "<0.001"]


def test_free_memory_below_the_weights_is_refused(monkeypatch):
    monkeypatch.setattr(preflight, "device_memory", lambda dev: (10 * GB, 48 * GB))
    with pytest.raises(ConfigError, match=r"budget is 10\.0 GB \(10\.0 GB free of 48\.0\).*more free memory"):
        preflight.kv_budget(llama3(), spec(llama3(), 4096), None)


def test_a_cpu_runs_emulated_budget_below_the_weights_is_refused(monkeypatch):
    monkeypatch.setattr(preflight, "host_available_bytes", lambda: 1000 * GB)
    cfg = llama3()
    with pytest.raises(ConfigError, match=r"the budget is 8\.0 GB \(hardware.gpu_mem_gb\), less than llama3"):
        preflight.kv_budget(cfg, spec(cfg, 4096, device=torch.device("cpu")), 8)


def test_a_batch_that_cannot_fit_is_refused_with_the_estimate_and_the_largest_batch_that_fits(device):
    cfg = llama3()

    def estimate(s: KVSpec) -> preflight.MemoryPlan:
        return preflight.plan_memory(cfg, FullAttn(), s, s.prompt_tokens)

    s = spec(cfg, 32768, batch=16)
    s = replace(s, gpu_budget_bytes=preflight.kv_budget(cfg, s, None))
    with pytest.raises(ConfigError) as e:
        preflight.check_memory(estimate(s), CUDA, None, "this run", estimate, s, cfg.name)
    msg = str(e.value)
    need = estimate(s).device_total / GB
    assert f"needs about {need:.1f} GB of GPU memory" in msg and "budget is 40.0 GB (40.0 GB free of 48.0)" in msg
    b = int(re.search(r"batch=(\d+) or smaller", msg).group(1))
    limits = preflight.memory_limits(CUDA, None)
    assert preflight.shortfall(estimate(replace(s, batch=b)), limits) is None
    assert preflight.shortfall(estimate(replace(s, batch=b + 1)), limits) is not None


def test_a_prompt_that_cannot_fit_is_refused_with_the_longest_that_does(device):
    cfg = llama3()

    def estimate(s: KVSpec) -> preflight.MemoryPlan:
        return preflight.plan_memory(cfg, FullAttn(), s, s.prompt_tokens)

    s = spec(cfg, 262144)
    with pytest.raises(ConfigError) as e:
        preflight.check_memory(estimate(s), CUDA, None, "this run", estimate, s, cfg.name)
    n = int(re.search(r"seqlen=(\d+)k or shorter", str(e.value)).group(1)) * 1024
    limits = preflight.memory_limits(CUDA, None)
    assert preflight.shortfall(estimate(replace(s, prompt_len=n, max_len=n + 16)), limits) is None
    assert preflight.shortfall(estimate(replace(s, prompt_len=n + 1024, max_len=n + 1040)), limits) is not None
