"""What the benchmarks share: the Llama-3-8B shapes they time at (read from conf/model/llama3.yaml, not copied), the
GPU-only benches' device, their command-line parsing of counts, a timed copy's rate and a bench record, and the
link sweep (host -> device transfer paths against a bulk copy) that bench_link and bench_pin_alloc both run. A bench
script imports from here, never from another bench script; `--device` goes through the runner's
experiments.runner.run_settings.resolve_device."""

from __future__ import annotations

import math
import shlex
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from experiments.runner.records import environment
from experiments.runner.timing import capture, median_ms
from experiments.traces.step_timeline import kernels
from kvoffload.errors import ConfigError
from kvoffload.kernels.uva_gather import gather_rows_ref
from kvoffload.model.config import ModelConfig
from kvoffload.offload.link import paced_copy
from kvoffload.offload.transfer import TransferEngine
from kvoffload.paths import ROOT

LLAMA3 = ModelConfig.from_mapping(OmegaConf.load(ROOT / "conf/model/llama3.yaml"))
DEV = torch.device("cuda")  # the device of the GPU-only benches (bench_clo, bench_clo_layer, tune_*)
UVA_PROGRAMS = (16, 32, 64, 132, 264, 100000)  # caps on the gather's grid (100000: uncapped, one per tile)


def time_ms(fn, iters: int = 50) -> float:
    """Median of `iters` eager calls on the GPU, launch overhead included (what an eager caller pays)."""
    return median_ms(fn, DEV, iters, warmup=5)


def counts(text: str, what: str, parse=int) -> list[int]:
    """--<what> a,b,...: each parsed and at least 1, or a ConfigError naming the flag."""
    try:
        values = [parse(x) for x in text.split(",")]
    except (ValueError, ConfigError) as e:
        raise ConfigError(f"--{what} {text!r}: {e}") from None
    if not values or min(values) < 1:
        raise ConfigError(f"--{what} {text!r}: each must be at least 1")
    return values


def rate(nbytes: int, ms: float, bulk_ms: float) -> dict:
    """A timed copy's row fields: its bytes and time, GB/s and its share of the bulk copy's rate."""
    return {
        "bytes": nbytes,
        "ms": round(ms, 4),
        "gb_s": float(f"{nbytes / ms / 1e6:.4g}"),
        "of_bulk": round(bulk_ms / ms, 3),
    }


def bench_record(bench: str, module: str, argv: list[str] | None, device: torch.device, rows: list, **fields) -> dict:
    """A bench's record: what it measured, the command that ran it, its rows and the environment."""
    command = f"python -m {module} " + shlex.join(sys.argv[1:] if argv is None else argv)
    return {
        "bench": bench,
        "device": device.type,
        **fields,
        "command": command,
        "rows": rows,
        "environment": environment(device),
    }


def sweep(device, tokens, threads, kv_heads, head_dim, fraction, iters, uva_programs, pacers=(None,)) -> list[dict]:
    """Every path's rate at every volume (and the CPU gather's at every thread count), once per entry of `pacers`:
    None, the real link; a kvoffload.offload.link.LinkPacer (hardware.link_gb_s), every path through it, each row
    beside its cap. The host pool is made once for all of them (GBs of pinned memory at the largest volume)."""
    pool = math.ceil(max(tokens) / fraction)
    cuda = device.type == "cuda"
    host = torch.randn(1, kv_heads, pool, 2, head_dim, dtype=torch.bfloat16)
    host = host.pin_memory() if cuda else host
    heads = torch.arange(kv_heads, device=device)
    rows = []
    for pacer in pacers:
        cap = None if pacer is None else pacer.gb_s
        if cap is not None:
            print(f"-- every path paced to {cap:g} GB/s")
        for t in tokens:
            rows += volume(device, host, heads, t, threads, fraction, iters, uva_programs, pacer)
    return rows


def volume(device, host, heads, t, threads, fraction, iters, uva_programs, pacer) -> list[dict]:
    """sweep's rows of one volume, t tokens of every head."""
    cuda, (kv_heads, head_dim) = device.type == "cuda", (host.shape[1], host.shape[-1])
    cap = None if pacer is None else pacer.gb_s
    rows = []
    span = math.ceil(t / fraction)
    idx = torch.stack([torch.randperm(span)[:t].sort().values for _ in range(kv_heads)])[None].to(device)
    miss = torch.ones(1, kv_heads, dtype=torch.bool, device=device)
    slots = torch.zeros(1, kv_heads, t, 2, head_dim, dtype=torch.bfloat16, device=device)
    nbytes = slots.numel() * slots.element_size()
    src, dst = host.view(-1)[: slots.numel()], torch.empty(slots.numel(), dtype=torch.bfloat16, device=device)
    timed = [("bulk", None, lambda: paced_copy(pacer, dst, src))]
    engines = [("uva", None, TransferEngine("uva", 1, device, uva_programs, pacer))] if cuda else []
    engines += [
        ("cpu_gather", n, TransferEngine("cpu_gather", n, device, pacer=pacer)) for n in (threads if cuda else [1])
    ]
    for path, n, eng in engines:
        timed.append((path, n, lambda eng=eng: eng.fill(host, heads, idx, miss, slots)))
    bulk_ms = None
    for path, n, fn in timed:
        slots.zero_()
        ms = median_ms(fn, device, iters, warmup=1)
        bulk_ms = ms if path == "bulk" else bulk_ms
        row = {"path": path, "threads": n if cuda else None, "tokens": t} | rate(nbytes, ms, bulk_ms)
        if cap is not None:  # the achieved rate beside the cap it was paced to
            row |= {"cap_gb_s": cap, "of_cap": round(row["gb_s"] / cap, 3)}
        if path != "bulk":
            want = gather_rows_ref(host, heads.cpu(), idx.cpu())
            row["exact_rows"] = torch.equal(slots.cpu(), want)
        rows.append(row)
        beside = f" = {row['of_cap']:.3f} of the {cap:g} GB/s cap" if cap is not None else ""
        print(f"{t:>7} tokens {path:<10} {n or '':>2} {row['gb_s']:8.2f} GB/s = {row['of_bulk']:.2f} of bulk{beside}")
    return rows


def kernel_timeline(fn, path: Path) -> list[dict]:
    """Replays `fn` (captured in a graph, 3 times) under the torch profiler: writes its Chrome trace to `path`
    (open in Perfetto) and returns the GPU kernels of the last replay, [{name, stream, start_us, dur_us}], start
    relative to the replay's first kernel: which part waits for which when the two streams overlap."""
    from torch.profiler import ProfilerActivity, profile

    graph = capture(fn, 3)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    ks = kernels(path)
    if not ks:  # a profiler that does not see inside graphs
        return []
    last = ks[len(ks) - len(ks) // 3 :]
    t0 = last[0]["start"]
    return [
        {
            "name": k["name"][:60],
            "stream": k["stream"],
            "start_us": round(k["start"] - t0, 1),
            "dur_us": round(k["end"] - k["start"], 1),
        }
        for k in last
    ]
