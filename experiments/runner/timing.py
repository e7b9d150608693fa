"""Bandwidths and kernel times measured in the run itself, so every floor is computed against this machine's
numbers."""

from __future__ import annotations

import functools
import time

import torch

from kvoffload.kv.interface import CPU_LINK_GB_S
from kvoffload.offload.link import MECHANISM, shared_pacer
from kvoffload.offload.transfer import TransferEngine


def median_ms(fn, device: torch.device, repeats: int = 5, warmup: int = 1) -> float:
    """Median milliseconds of fn(): CUDA events on a GPU, a clock on a CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gb_s(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Device-to-device copy bandwidth (bytes read + written, GB/s = 1e9 B/s)."""
    if device.type != "cuda":
        nbytes = min(nbytes, 256 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / median_ms(lambda: dst.copy_(src), device, repeats) / 1e6


def pinned_h2d_gb_s(device: torch.device, nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Pinned host -> device copy bandwidth (GB/s = 1e9 B/s)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / median_ms(lambda: dst.copy_(src, non_blocking=True), device, repeats) / 1e6


@functools.cache
def link_gb_s(device: torch.device) -> float:
    """The host->device link that every system plans with and divides its moved bytes by: on CUDA a pinned copy,
    measured once per process and device (every system of a sweep sees the same link); on a CPU run CPU_LINK_GB_S."""
    return pinned_h2d_gb_s(device) if device.type == "cuda" else CPU_LINK_GB_S


def paced_link(device: torch.device, cap_gb_s: float, bulk_gb_s: float, nbytes: int = 32 << 20) -> dict:
    """The record's account of hardware.link_gb_s: the cap, how it is kept, the bulk copy measured unpaced, and the
    rates that the pacer (the run's own, shared_pacer) lets a bulk pinned copy and a UVA gather of scattered rows
    (Llama-3 rows: 8 KV heads, 512 B) reach, nbytes each, measured here as the run starts."""
    pacer = shared_pacer(device, cap_gb_s)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    bulk_ms = median_ms(lambda: pacer.copy_(dst, src), device)
    heads, row = 8, 512
    k = nbytes // (heads * row)
    host = torch.empty(1, heads, 2 * k, 2, row // 4, dtype=torch.bfloat16, pin_memory=True)
    idx = torch.stack([torch.randperm(2 * k)[:k].sort().values for _ in range(heads)])[None].to(device)
    slots = torch.empty(1, heads, k, 2, row // 4, dtype=torch.bfloat16, device=device)
    miss = torch.ones(1, heads, dtype=torch.bool, device=device)
    engine = TransferEngine("uva", 1, device, 32, pacer)  # CLO's default uva_programs
    on = torch.arange(heads, device=device)
    uva_ms = median_ms(lambda: engine.fill(host, on, idx, miss, slots), device)
    return {
        "cap_gb_s": cap_gb_s,
        "mechanism": MECHANISM,
        "bulk_unpaced_gb_s": round(bulk_gb_s, 2),
        "achieved_gb_s": {
            "bulk": round(nbytes / bulk_ms / 1e6, 2),
            "uva_gather": round(slots.nbytes / uva_ms / 1e6, 2),
        },
    }


def replay_ms(fn, reps: int = 20, iters: int = 10, stream: torch.cuda.Stream | None = None) -> float:
    """Per-call milliseconds of `fn` replayed `reps` times from one CUDA graph: the GPU's own time, without the
    host launch overhead that an eager call (or a per-call event pair) would add."""
    return median_ms(capture(fn, reps, stream).replay, torch.device("cuda"), iters, warmup=0) / reps


def capture(fn, reps: int = 1, stream: torch.cuda.Stream | None = None) -> torch.cuda.CUDAGraph:
    """`fn` called `reps` times, captured in one CUDA graph (after one eager call, which creates lazy state) on
    `stream`, by default on one like the runner's decode step (kvoffload.generate.step_stream: highest priority)."""
    from kvoffload.generate import step_stream

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream or step_stream(torch.device("cuda"))):
        for _ in range(reps):
            fn()
    return graph


def dense_work(layer, batch: int, speculative: bool = False):
    """A closure running one decoder layer's dense work for a decode step of `batch` sequences, as
    Decoder.dense_segment does it (o_proj, MLP, norms, q/k/v with RoPE; no attention). speculative: the next
    layer's speculative query too (its norm and q projection; `layer`'s weights stand in for the next layer's)."""
    p = layer.input_layernorm.weight
    a = layer.self_attn
    x = torch.randn(batch, 1, p.shape[0], device=p.device, dtype=p.dtype)
    o = torch.randn(batch, a.h, a.d, device=p.device, dtype=p.dtype)
    position = torch.tensor([1000], device=p.device)
    inv_freq = torch.rand(a.d // 2, device=p.device)  # the values do not change the work

    def work():
        return layer.decode_inputs(*layer.decode_mlp(x, o), position, inv_freq, layer if speculative else None)

    return work


def layer_time_s(layer, batch: int, repeats: int = 5) -> float:
    """One decoder layer's dense work for one decode step: the T_comp that one-layer-ahead prefetch can hide
    transfers behind (attention excluded). On CUDA replayed from a graph, as a decode step is; eager timing
    would count Python launch overhead as compute."""
    p = layer.input_layernorm.weight
    work = dense_work(layer, batch)
    with torch.inference_mode():
        if p.is_cuda:
            return replay_ms(work) / 1e3
        return median_ms(work, p.device, repeats) / 1e3


def model_layer_time_s(cfg, batch: int, device: torch.device, dtype: torch.dtype) -> float:
    """layer_time_s of one layer of `cfg`'s shapes with constant weights (the work does not depend on their
    values; no random init to wait for): measured before any weight is loaded, so that a system's plan, and with
    it its memory estimate, is the one it will allocate."""
    from kvoffload.model.decoder import Layer

    with torch.device("meta"):
        layer = Layer(cfg)
    layer = layer.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.fill_(0.01)
    return layer_time_s(layer, batch)
