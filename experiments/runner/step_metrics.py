"""A run's measurements from its decode steps: means over the steady steps, hit rates, bytes, and the floors (the
dense HBM floor and the system's own) beside the step."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch

from kvoffload.generate import Generation
from kvoffload.kv.interface import GB, KVOffloadSystem, KVSpec
from kvoffload.kv.timer import PHASES
from kvoffload.model.config import ModelConfig


def trace_phases(trace: Path | None) -> dict[str, float] | None:
    """The traced step's phases, or None without a trace or without GPU kernels in it (a CPU run)."""
    from experiments.runner.trace_phases import load_events, step_phases

    if trace is None or not trace.is_file():
        return None
    try:
        return step_phases(load_events(trace))
    except ValueError:
        return None


def metrics(
    gen: Generation,
    system: KVOffloadSystem,
    cfg: ModelConfig,
    spec: KVSpec,
    seqlen: int,
    hbm_gb_s: float,
    link_gb_s: float | None,
    warmup: int,
    kv_fill: str = "prefill",
) -> dict[str, Any]:
    # The first steps pay one-off costs (kernel JIT, allocator growth): they stay in the record, not the means.
    # With a graph, the capture step too (it runs the step eagerly while recording it).
    steps = gen.steps[max(warmup, gen.steady_from) :] or gen.steps
    n = max(len(steps), 1)
    phase_ms = {p: statistics.fmean(s.phase_ms[p] for s in steps) if steps else 0.0 for p in (*PHASES, "total")}
    lookups, refreshes = sum(s.lookups for s in steps), sum(s.refreshes for s in steps)
    held = system.memory_held()
    # The HBM floor of a dense step: every weight and every held K/V byte read once per step.
    mean_len = seqlen + n / 2
    kv_read = cfg.kv_bytes_per_token(spec.dtype_bytes) * spec.batch * mean_len
    floor_ms = (cfg.num_params * spec.dtype_bytes + kv_read) / (hbm_gb_s * 1e9) * 1e3
    step_ms = phase_ms["total"]
    # The system's own floor: the bytes it must read from device memory, the bytes it moves over the link and its
    # own CPU work per step, each at the rate measured in this run, summed (the definition of a system's own
    # floor: a system that overlaps them can step below it; the parts are recorded too).
    sys_bytes = system.step_device_bytes()
    sys_floor_ms, floor_parts = None, None
    if sys_bytes is not None:
        h2d = sum(s.bytes_h2d for s in steps) / n
        floor_parts = {
            "device": (cfg.num_params * spec.dtype_bytes + sys_bytes) / (hbm_gb_s * 1e9) * 1e3,
            "link": h2d / (link_gb_s * 1e9) * 1e3 if link_gb_s else 0.0,
            "host_work": sum(s.host_work_ms for s in steps) / n,
        }
        sys_floor_ms = sum(floor_parts.values())
    return {
        "prefill_s": round(gen.prefill_s, 4),  # with kv_fill=projection: the fill's time, not a prefill's
        "prefill_tokens_per_s": round(spec.batch * seqlen / gen.prefill_s, 1) if kv_fill == "prefill" else None,
        "decode_steps": len(gen.steps),
        "decode_steps_measured": len(steps),
        "decode_wall_tokens_per_s": round(gen.decode_tokens_per_s, 2),  # all steps, warm-up and loop included
        "decode_tokens_per_s": round(spec.batch * 1e3 / step_ms, 2) if step_ms else 0.0,
        "decode_ms_per_step": round(step_ms, 3),
        "phase_ms_per_step": {k: round(v, 4) for k, v in phase_ms.items()},
        "hit_rate": (sum(s.hits for s in steps) / lookups) if lookups else None,
        # the same hits over every unit the step could have served from its cache, the refreshes (fetched by design,
        # CLO's prefetch heads) counted as fetched
        "hit_rate_with_refreshes": (sum(s.hits for s in steps) / (lookups + refreshes)) if lookups else None,
        "hit_unit": system.hit_unit,
        "lookups_per_step": lookups / n,
        "refreshes_per_step": refreshes / n,
        "bytes_h2d_per_step": sum(s.bytes_h2d for s in steps) / n,
        "bytes_d2h_per_step": sum(s.bytes_d2h for s in steps) / n,
        "host_syncs_per_step": sum(s.host_syncs for s in steps) / n,
        "kv_device_gb": round(held.device_bytes / GB, 4),
        "kv_host_gb": round(held.host_bytes / GB, 4),
        "peak_device_gb": round(torch.cuda.max_memory_allocated() / GB, 3) if spec.device.type == "cuda" else None,
        "bandwidth_gb_s": round(hbm_gb_s, 1),
        "dense_floor_ms_per_step": round(floor_ms, 4),
        "step_over_floor": round(step_ms / floor_ms, 3),
        "system_floor_ms_per_step": round(sys_floor_ms, 4) if sys_floor_ms else None,
        "system_floor_parts_ms": {k: round(v, 4) for k, v in floor_parts.items()} if floor_parts else None,
        "step_over_system_floor": round(step_ms / sys_floor_ms, 3) if sys_floor_ms else None,
    }
