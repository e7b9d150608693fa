"""kv_dtype=fp8 (docs/fp8.md): every offloading system keeps its host rows packed FP8, estimates what it then holds,
decodes, and moves fewer bytes; the preflight counts the smaller rows (about twice the sequences a host holds at
Llama-3-8B's shapes); bad settings are one `error:` line before any allocation."""

from dataclasses import replace

import pytest
import torch
from omegaconf import OmegaConf

from experiments.runner import preflight, run_settings
from kvoffload.errors import ConfigError
from kvoffload.kernels import fp8_rows
from kvoffload.kv.interface import GB, KVSpec, check_kv_dtype
from kvoffload.kv.timer import PhaseTimer
from kvoffload.model.rope import rope_frequencies
from tests.run_helpers import FAST, run, single_error
from tests.test_system_contract import build, prefill_random

OFFLOADING = ["clo", "infinigen", "pqcache", "retroinfer", "shadowkv"]


def decoded(name: str, kv_dtype: str, t0: int = 1000, steps: int = 2):
    """(system, spec, [outputs of the last step's layers], bytes moved by the last step) of a CPU run on random K/V."""
    system, spec = build(name, t0)
    spec = replace(spec, kv_dtype=kv_dtype, max_len=t0 + steps)
    estimate = system.estimate_parts(spec)
    system.allocate(spec, PhaseTimer(spec.device, enabled=False))
    g = prefill_random(system, spec)
    assert system.memory_parts() == estimate
    with torch.inference_mode():
        for _ in range(steps):
            system.begin_step()
            outs = []
            for layer in range(spec.num_layers):
                q = torch.randn(spec.batch, spec.num_heads, spec.head_dim, generator=g)
                if system.wants_speculative_query and layer + 1 < spec.num_layers:
                    system.prepare(layer + 1, q)
                k, v = (torch.randn(spec.batch, spec.num_kv_heads, spec.head_dim, generator=g) for _ in "kv")
                outs.append(system.decode(layer, q, k, v))
            stats = system.end_step()
    return system, spec, outs, stats


@pytest.mark.slow
@pytest.mark.parametrize("name", OFFLOADING)
def test_fp8_host_stores_hold_packed_rows_and_decode(name):
    """The host part shrinks by the row's bytes (fp32 CPU rows: 512 -> 132 for SmolLM2's D = 64), the device parts
    that hold model-dtype rows (window, dense layers) stay, the estimate is what is allocated, decode is finite."""
    ref, _, _, _ = decoded(name, "model")
    system, spec, outs, _ = decoded(name, "fp8")
    assert spec.host_row_bytes == 2 * (spec.head_dim + fp8_rows.SCALE_BYTES) < spec.row_bytes
    parts, before = system.memory_parts(), ref.memory_parts()
    assert parts["host"] * spec.row_bytes == before["host"] * spec.host_row_bytes
    assert parts["window"] == before["window"]
    assert all(torch.isfinite(o).all() for o in outs)
    stores = [h for h in getattr(system, "host", getattr(system, "host_v", [])) if h is not None]
    stores += [s.host for s in getattr(system, "stores", []) if s is not None]
    assert stores and all(h.dtype == torch.uint8 for h in stores)


@pytest.mark.slow
def test_clo_fp8_moves_packed_rows_and_stays_close_to_bf16():
    """CLO's misses move host_row_bytes a row (Eq. 12 plans with them), and its output differs from the
    unquantised run's by FP8 rounding only."""
    from clo.system import CLO

    outs, moved = {}, {}
    for kv_dtype in ("model", "fp8"):
        _, spec = build("clo", 2000)
        spec = replace(spec, kv_dtype=kv_dtype)
        system = CLO(persistent=False, retriever="exact", speculative=False)
        system.allocate(spec, PhaseTimer(spec.device, enabled=False))
        g = prefill_random(system, spec)
        with torch.inference_mode():
            system.begin_step()
            outs[kv_dtype] = [
                system.decode(
                    layer,
                    torch.randn(spec.batch, spec.num_heads, spec.head_dim, generator=g),
                    *(torch.randn(spec.batch, spec.num_kv_heads, spec.head_dim, generator=g) for _ in "kv"),
                )
                for layer in range(spec.num_layers)
            ]
            moved[kv_dtype] = system.end_step().bytes_h2d
    assert moved["fp8"] * spec.row_bytes == moved["model"] * spec.host_row_bytes > 0
    diff = max((a - b).abs().max().item() for a, b in zip(outs["model"], outs["fp8"]))
    assert 0 < diff < 0.1


def llama3(name: str):
    """(a fresh system of conf/system/<name>.yaml, the model's config) at Llama-3-8B's shapes and profiles."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from kvoffload.model.config import ModelConfig
    from kvoffload.paths import ROOT

    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=[f"system={name}", "model=llama3"])
    return instantiate(cfg.system), ModelConfig.from_mapping(OmegaConf.to_container(cfg.model, resolve=True))


def sequences_held(name: str, seqlen: int, kv_dtype: str, host_bytes: int) -> int:
    """The largest batch whose host stores, pinned as on CUDA, the preflight's host check (plan_memory, shortfall)
    lets a host of host_bytes hold: shapes only, nothing is allocated."""
    limits = preflight.Limits(torch.device("cuda"), host_bytes, None)

    def fits(batch: int) -> bool:
        system, m = llama3(name)
        spec = KVSpec(
            m.num_layers,
            batch,
            seqlen + 256,
            m.num_heads,
            m.num_kv_heads,
            m.head_dim,
            torch.bfloat16,
            torch.device("cuda"),
            prompt_len=seqlen,
            rope_inv_freq=rope_frequencies(m),
            kv_dtype=kv_dtype,
            **preflight.UNMEASURED,
        )
        return preflight.shortfall(preflight.plan_memory(m, system, spec, seqlen), limits) is None

    return preflight.largest(fits, 1, 4096) or 0


HOST_GB = 512  # a GPU server's RAM (assumed, not measured): the count scales with it


@pytest.mark.parametrize("seqlen", [32 * 1024, 128 * 1024])
@pytest.mark.parametrize("name", OFFLOADING)
def test_the_host_holds_about_twice_the_sequences_in_fp8(name, seqlen, record_property):
    model = sequences_held(name, seqlen, "model", HOST_GB * GB)
    fp8 = sequences_held(name, seqlen, "fp8", HOST_GB * GB)
    record_property("sequences", {"model": model, "fp8": fp8})
    print(f"{name} {seqlen // 1024}K: {model} -> {fp8} sequences in {HOST_GB} GiB")
    assert model >= 1 and fp8 >= 1.9 * model


def test_a_system_that_offloads_nothing_refuses_fp8():
    system, spec = build("fullattn", 50)
    with pytest.raises(ConfigError, match="keeps no KV in host memory"):
        system.allocate(replace(spec, kv_dtype="fp8"), PhaseTimer(spec.device, enabled=False))


def test_fp8_without_torch_float8_is_refused(monkeypatch):
    monkeypatch.setattr("kvoffload.kv.interface.fp8_dtype", lambda: None)
    with pytest.raises(ConfigError, match="needs torch.float8_e4m3fn"):
        check_kv_dtype("fp8", "clo", ("model", "fp8"))


def test_the_systems_offering_fp8_are_the_offloading_ones():
    assert run_settings.fp8_systems() == sorted(OFFLOADING)


@pytest.mark.parametrize(
    "args,message",
    [
        (["kv_dtype=int4", "system=clo"], "kv_dtype='int4'; valid: model (every system), fp8 (system=clo, infinigen"),
        (["kv_dtype=fp8", "system=fullattn"], "kv_dtype=fp8 with system=fullattn, which keeps no KV in host memory"),
    ],
)
def test_a_bad_kv_dtype_is_one_error_line(tmp_path, args, message):
    line = single_error(run(*args, "seqlen=64", *FAST, tmp=tmp_path, check=False))
    assert message in line and "shadowkv" in line


@pytest.mark.parametrize("contiguous", [True, False])
def test_rows_are_quantised_on_their_way_a_bounded_number_at_a_time(monkeypatch, contiguous):
    """copy_rows stores what quantize_rows makes of the whole layer at once, in chunks of QUANTIZE_ROWS rows (here a
    few, so that chunks cross sequence and head boundaries, or stay inside them where kv is a strided view)."""
    from kvoffload.offload import host as host_memory

    monkeypatch.setattr(host_memory, "QUANTIZE_ROWS", 5)
    calls = []
    quantize = host_memory.quantize_rows
    monkeypatch.setattr(host_memory, "quantize_rows", lambda x: calls.append(x.shape[0]) or quantize(x))
    kv = torch.randn(2, 3, 13 if contiguous else 20, 2, 8, dtype=torch.bfloat16)
    kv = kv if contiguous else kv[:, :, :13]
    host = torch.zeros(2, 3, 13, 2, fp8_rows.packed_width(8), dtype=torch.uint8)
    host_memory.copy_rows(None, host, kv)
    assert torch.equal(host, fp8_rows.quantize_rows(kv))
    assert max(calls) <= 5 and sum(calls) == 2 * 3 * 13


def test_the_preflight_counts_the_quantisation_beside_the_prefill():
    from kvoffload.offload.host import quantize_peak_bytes

    system, m = llama3("clo")
    plans = {}
    for kv_dtype in ("model", "fp8"):
        spec = KVSpec(
            m.num_layers, 1, 4096 + 16, m.num_heads, m.num_kv_heads, m.head_dim, torch.bfloat16,
            torch.device("cuda"), prompt_len=4096, rope_inv_freq=rope_frequencies(m), kv_dtype=kv_dtype,
            **preflight.UNMEASURED,
        )  # fmt: skip
        plans[kv_dtype] = preflight.plan_memory(m, system, spec, 4096)
    assert plans["fp8"].activations - plans["model"].activations == quantize_peak_bytes(m.head_dim) > 0
