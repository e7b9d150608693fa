"""ShadowKV-style on CUDA (its static path: fixed shapes, UVA value reads) against the CPU reference path, and its
refill with no host sync (run on the GPU machine: pytest -m gpu)."""

import pytest
import torch

from baselines.shadowkv import ShadowKV
from experiments.runner.timing import link_gb_s
from kvoffload.kv.interface import KVSpec
from kvoffload.kv.timer import PhaseTimer

pytestmark = pytest.mark.gpu
CUDA, CPU = torch.device("cuda"), torch.device("cpu")
B, HQ, HKV, D, LAYERS, T0, STEPS = 2, 8, 2, 64, 3, 1536, 4
INV_FREQ = tuple((1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))).tolist())
SETTINGS = {"budget": 128, "rank": 96, "outlier_chunks": 6, "dense_layers": 1}


def system_on(device: torch.device, dtype: torch.dtype, path: str) -> ShadowKV:
    link = link_gb_s(device) if device.type == "cuda" else None
    spec = KVSpec(LAYERS, B, T0 + STEPS, HQ, HKV, D, dtype, device, prompt_len=T0, link_gb_s=link,
                  rope_inv_freq=INV_FREQ)  # fmt: skip
    system = ShadowKV(path=path, **SETTINGS)
    system.allocate(spec, PhaseTimer(device, enabled=False))
    return system


def inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    prompt = [torch.randn(2, B, HKV, T0, D, generator=g) for _ in range(LAYERS)]
    steps, q = [], torch.randn(B, HQ, D, generator=g)
    for _ in range(STEPS):
        q = q + 0.5 * torch.randn(B, HQ, D, generator=g)
        steps.append((q, torch.randn(LAYERS, 2, B, HKV, D, generator=g)))
    return prompt, steps


def run(system: ShadowKV, device, dtype, prompt, steps):
    outs, stats = [], []
    with torch.inference_mode():
        for layer, (k, v) in enumerate(prompt):
            system.prefill(layer, k.to(device, dtype), v.to(device, dtype))
        system.end_prefill(T0)
        for q, kv in steps:
            system.begin_step()
            kv, qd = kv.to(device, dtype), q.to(device, dtype)
            outs.append([system.decode(layer, qd, *kv[layer]).float().cpu() for layer in range(LAYERS)])
            stats.append(system.end_step())
    return outs, stats


def test_the_cuda_path_attends_what_the_cpu_reference_does():
    prompt, steps = inputs(0)
    ref_out, ref_stats = run(system_on(CPU, torch.float32, "reference"), CPU, torch.float32, prompt, steps)
    gpu = system_on(CUDA, torch.float32, "auto")
    assert gpu.static
    out, stats = run(gpu, CUDA, torch.float32, prompt, steps)
    for a, b in zip(ref_stats, stats):
        assert (a.lookups, a.hits, a.bytes_h2d) == (b.lookups, b.hits, b.bytes_h2d)
    assert 0 < stats[-1].hits < stats[-1].lookups
    for x, y in zip(ref_out, out):
        for a, b in zip(x, y):
            assert torch.allclose(a, b, atol=2e-3, rtol=1e-3)


def test_bf16_on_cuda_moves_only_the_missed_chunks_values():
    prompt, steps = inputs(1)
    out, stats = run(system_on(CUDA, torch.bfloat16, "auto"), CUDA, torch.bfloat16, prompt, steps)
    assert all(torch.isfinite(o).all() for step in out for o in step)
    assert all(s.bytes_h2d == (s.lookups - s.hits) * 8 * D * 2 for s in stats)  # a chunk's bf16 values
    assert stats[0].hits == 0 and all(s.hits > 0 for s in stats[1:])


def test_the_static_refill_never_syncs_the_host():
    prompt, steps = inputs(2)
    system = system_on(CUDA, torch.bfloat16, "auto")
    run(system, CUDA, torch.bfloat16, prompt, steps[:1])
    layer = SETTINGS["dense_layers"]
    chunks = system.landmark_chunks[layer][..., : system.g.select].flip(-1).contiguous()
    system.begin_step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        system.refill_static(layer, chunks)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert (system.selected_chunks[layer].sort(-1).values == chunks.sort(-1).values).all()
