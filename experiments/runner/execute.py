"""One run of the decode workload: validate, plan memory, build model and KV system, generate, measure."""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from experiments.runner import preflight, run_settings
from experiments.runner.records import config_error, environment
from experiments.runner.setting_types import check_system_settings
from experiments.runner.timing import copy_bandwidth_gb_s, link_gb_s, model_layer_time_s, paced_link
from experiments.workloads.prompts import PROMPTS, build_prompt
from kvoffload.errors import ConfigError
from kvoffload.generate import Generation, generate
from kvoffload.kv.interface import GB, KVOffloadSystem, KVSpec
from kvoffload.kv.timer import PHASES, PhaseTimer
from kvoffload.model.config import ModelConfig
from kvoffload.model.rope import rope_frequencies
from kvoffload.model.weights import build_decoder
from kvoffload.offload.host import THP_TUNABLE, anon_huge_gib, huge_pages_enabled, pin_by_register


def load_tokenizer(source: str, model_cfg: DictConfig):
    if source == "synthetic":
        return None
    from transformers import AutoTokenizer

    from kvoffload.model.weights import smollm2_folder

    folder = smollm2_folder() if source == "smollm2-gguf" else Path(model_cfg.path)
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError):
        return None  # a checkpoint without tokenizer files: the workload falls back to random prompts


def resolve_queries(setting: str, source: str, model_cfg: DictConfig) -> str:
    """workload.query_process -> "model" or a profile: `auto` gives synthetic weights their model's synthetic
    queries (random weights have no realistic query dynamics) and real weights their own."""
    if setting != "auto":
        return setting
    if source == "synthetic":
        return model_cfg.get("synthetic_queries") or "model"
    return "model"


def build_system(system_cfg: DictConfig, system_name: str) -> KVOffloadSystem:
    """instantiate(cfg.system); a ConfigError its constructor raises (Hydra wraps it in an InstantiationException)
    comes out as a ConfigError naming the system."""
    try:
        return instantiate(system_cfg)
    except InstantiationException as e:
        err = config_error(e)
        if err is None:
            raise
        raise ConfigError(f"system={system_name}: {err}") from e


def execute(cfg: DictConfig, system_name: str) -> dict[str, Any]:
    # ---- everything that can be refused is checked before any weight is loaded --------------------------
    run_settings.check_decode_workload(cfg)
    numbers = run_settings.check_numbers(cfg)
    run_settings.check_kv_fill(cfg, numbers.kv_fill)
    check_system_settings(OmegaConf.to_container(cfg.system, resolve=True))
    model_cfg = ModelConfig.from_mapping(OmegaConf.to_container(cfg.model, resolve=True))
    seqlen, batch, gen_tokens = numbers.seqlen, numbers.batch, numbers.gen_tokens
    run_settings.check_length(model_cfg, seqlen, gen_tokens)
    run_settings.check_model_path(cfg)
    stages = StageMarks()
    device = run_settings.resolve_device(cfg.device)
    dtype = run_settings.resolve_dtype(cfg.dtype, device)
    cap = numbers.link_cap_gb_s  # hardware.link_gb_s: refused on a CPU run before anything is built
    run_settings.check_link_cap(cap, device)
    system = build_system(cfg.system, system_name)
    kv_dtype = run_settings.kv_dtype(cfg, system, system_name)  # the host stores' format (docs/fp8.md)
    chunk, fill = numbers.prefill_chunk, numbers.kv_fill
    what = f"system={system_name} model={model_cfg.name} seqlen={preflight.tokens_text(seqlen)} batch={batch}"

    def plan_of(s: KVSpec) -> preflight.MemoryPlan:  # a changed run, planned by a fresh system: the ways out
        return preflight.plan_memory(model_cfg, build_system(cfg.system, system_name), s, s.prompt_tokens, chunk, fill)

    def estimate(s: KVSpec) -> preflight.MemoryPlan:  # the same under the run's device budget
        return plan_of(replace(s, gpu_budget_bytes=preflight.kv_budget(model_cfg, s, numbers.gpu_mem_gb, chunk, fill)))

    shapes = KVSpec(
        model_cfg.num_layers,
        batch,
        seqlen + gen_tokens,
        model_cfg.num_heads,
        model_cfg.num_kv_heads,
        model_cfg.head_dim,
        dtype,
        device,
        prompt_len=seqlen,
        rope_inv_freq=rope_frequencies(model_cfg),
        kv_dtype=kv_dtype,
        **preflight.UNMEASURED,
    )
    # a point beyond the host's RAM or the budget is refused before the device's context starts and anything is
    # measured
    preflight.check_before_measuring(model_cfg, system, shapes, chunk, fill, what, plan_of, numbers.gpu_mem_gb)
    free_at_start = None
    if device.type == "cuda":
        check_huge_pages(numbers)
        pin_by_register(numbers.pin_threads)
        free_at_start = round(torch.cuda.mem_get_info(device)[0] / GB, 3)  # the first call makes the context
    stages.device = device
    stages.mark("device")  # the system's build, the host's check, the driver's start and a context's
    source = run_settings.weights_source(cfg.model)
    key_process = None
    if numbers.kv_fill == "key_process":  # loads and checks its profile now
        from experiments.workloads.key_process import KeyProcess

        key_process = KeyProcess.from_profile(
            cfg.model.synthetic_keys, model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim, numbers.seed
        )
    # the link and one layer's dense time are measured first: the system's plan, its memory estimate and its
    # allocation all read them. A link cap above the measured link is refused before anything else is allocated; under
    # a cap, plans and floors read the cap as the link
    link = link_gb_s(device)
    run_settings.check_link_cap(cap, device, link)
    layer_s = model_layer_time_s(model_cfg, batch, device, dtype)
    budget = preflight.kv_budget(model_cfg, shapes, numbers.gpu_mem_gb, chunk, fill)  # reads neither placeholder
    spec = replace(shapes, link_gb_s=cap or link, link_cap_gb_s=cap, layer_time_s=layer_s, gpu_budget_bytes=budget)
    plan = preflight.plan_memory(model_cfg, system, spec, seqlen, chunk, fill)
    preflight.check_memory(plan, device, numbers.gpu_mem_gb, what, estimate, spec, model_cfg.name)
    decode_mode = run_settings.resolve_decode_mode(cfg.decode_mode, device, system)
    if cfg.workload.prompt not in PROMPTS:
        raise ConfigError(f"workload.prompt={cfg.workload.prompt!r}; valid: {', '.join(PROMPTS)}")
    query_process, queries = None, resolve_queries(cfg.workload.query_process, source, cfg.model)
    if queries != "model":  # loads and checks its profile now
        from experiments.workloads.query_process import ProfileQueryProcess

        query_process = ProfileQueryProcess.from_profile(
            queries, model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.group_size, device
        )
        if key_process is not None:  # its first query's heads coherent and key-aligned, as real ones
            query_process.first_query = key_process.first_query
    tokenizer = load_tokenizer(source, cfg.model)  # the prompt too: a needle needs a tokenizer and room
    prompt = build_prompt(
        cfg.workload.prompt, seqlen, batch, numbers.seed, tokenizer, model_cfg.vocab_size, numbers.needle_depth
    )

    # ---- long work ---------------------------------------------------------------------------------------
    query_desc = query_process.description if query_process is not None else "the model's own queries"
    keys_desc = key_process.description if key_process is not None else None
    keys_line = f"; keys: {keys_desc}" if keys_desc else ""  # else the model's own keys, from its prefill
    log(f"[run] {what} on {device} ({dtype}); loading {source} weights; queries: {query_desc}{keys_line}")
    hbm = numbers.hbm_gb_s or copy_bandwidth_gb_s(device)
    unpaced = {"cap_gb_s": None, "bulk_unpaced_gb_s": round(link, 2) if device.type == "cuda" else None}
    link_record = paced_link(device, cap, link) if cap is not None else unpaced
    stages.mark("measure")  # the link, HBM, one layer's time, the plan, the prompt: all before the weights load
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # the record's peak is the run's, not its measurements' buffers
    snapshot = Path(cfg.memory_snapshot) if cfg.get("memory_snapshot") and device.type == "cuda" else None
    if snapshot is not None:
        torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=2_000_000)
    model, weights_desc = build_decoder(model_cfg, source, cfg.model.get("path"), numbers.seed, device, dtype)
    stages.mark("weights")
    model.query_process, model.key_process = query_process, key_process
    model.prefill_chunk = chunk
    # Events cannot time phases inside a replayed graph: graph runs time whole steps only.
    timer = PhaseTimer(device, enabled=bool(cfg.profile_phases) and decode_mode != "graph")
    system.allocate(spec, timer)  # refuses a KV plan that does not fit the budget
    stages.mark("allocate")
    # the process's memory on huge pages once its stores are pinned (by threads; CUDA only: a CPU run pins nothing)
    huge_gb = anon_huge_gib() if numbers.pin_threads and device.type == "cuda" else None
    stop = {tokenizer.eos_token_id} if tokenizer is not None and cfg.workload.stop_at_eos else set()
    trace = Path(cfg.trace_dir) / "decode_step.trace.json" if cfg.get("trace_dir") else None
    gen = run_generation(
        model,
        system,
        prompt.tokens.to(device),
        gen_tokens,
        stop,
        decode_mode,
        trace,
        numbers.warmup_steps,
        fill,
        on_filled=lambda: stages.mark("fill"),
        on_first_token=lambda: stages.mark("first_step"),
    )
    stages.mark("decode")
    if snapshot is not None:
        snapshot.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(snapshot))
        torch.cuda.memory._record_memory_history(enabled=None)

    text = tokenizer.decode(gen.tokens[0], skip_special_tokens=True) if tokenizer is not None else None
    state = system.describe()
    return {
        "system": system_name,
        "model": model_cfg.name,
        "weights": weights_desc,
        "seqlen": seqlen,
        "batch": batch,
        "decode_mode": decode_mode,
        "phases_timed": timer.enabled,
        "query_process": query_desc,
        "kv_fill": KV_FILL_TEXT[fill],
        "key_process": keys_desc,
        "prompt": {"kind": prompt.kind, "tokens": int(prompt.tokens.shape[1]), **prompt.meta},
        "answer": {
            "expected": prompt.answer,
            "text": text,
            "found": (prompt.answer in text) if prompt.answer and text is not None else None,
        },
        "environment": {
            **environment(device),
            "device_free_gb_at_start": free_at_start,
            "process_huge_pages_gb_after_allocate": huge_gb,
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        },
        "metrics": metrics(
            gen, system, model_cfg, spec, seqlen, hbm, state.get("link_gb_s"), numbers.warmup_steps, fill
        ),
        "system_state": state,
        "link": link_record,  # hardware.link_gb_s: the cap, its mechanism, the rates it let through
        "memory_plan_gb": {k: round(v / GB, 3) for k, v in plan.__dict__.items()},
        "stages": stages.marks,
        # a graph-replayed step's phases, read from the traced step's kernels (experiments.runner.trace_phases)
        "trace_phase_ms": trace_phases(trace),
        "steps": [s.as_dict() for s in gen.steps],
    }


def trace_phases(trace: Path | None) -> dict[str, float] | None:
    """The traced step's phases, or None without a trace or without GPU kernels in it (a CPU run)."""
    from experiments.runner.trace_phases import load_events, step_phases

    if trace is None or not trace.is_file():
        return None
    try:
        return step_phases(load_events(trace))
    except ValueError:
        return None


KV_FILL_TEXT = {
    "prefill": "prefill: the model's own prefill of the prompt",
    "projection": "projection: each layer's K/V projection of the prompt's embeddings (no attention, no MLP), then "
    "the system's own prefill work; prefill tokens/s not measured",
    "key_process": "key_process: as projection, with each layer's keys drawn from the model's synthetic key process "
    "(experiments/workloads/key_process.py); prefill tokens/s not measured",
}


def check_huge_pages(numbers: run_settings.RunNumbers) -> None:
    """A run that pins by threads must have glibc's huge-page tunable exactly when it asks for huge pages: glibc
    reads its tunables when a process starts, so a job cannot change them (python -m experiments.run restarts
    itself with it; a fresh job gets it as its settings ask)."""
    if numbers.pin_threads and numbers.pin_huge_pages != huge_pages_enabled():
        raise ConfigError(
            f"hardware.pin_huge_pages={str(numbers.pin_huge_pages).lower()} but this process started "
            + ("without" if numbers.pin_huge_pages else "with")
            + f" GLIBC_TUNABLES={THP_TUNABLE}: python -m experiments.run sets it for its own config; a sweep "
            "mixing true and false needs job_process=fresh; else set or unset it in the environment"
        )


class StageMarks:
    """Each stage's wall time and the device's peak allocation so far at its end: startup (the process's age when
    the run begins: imports, Hydra), device (the system's build and the host's check, then the driver's and a
    context's start), measure, weights, allocate, fill, first_step (the first decode step, eager), decode. Where a
    sweep's time goes, and which stage set the record's peak_device_gb."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device, self.last = device, time.perf_counter()
        self.marks: dict[str, dict[str, float | None]] = {"startup": {"s": process_age_s(), "peak_gb": None}}

    def mark(self, stage: str) -> None:
        now = time.perf_counter()
        cuda = self.device is not None and self.device.type == "cuda"
        peak = torch.cuda.max_memory_allocated(self.device) / GB if cuda else None
        self.marks[stage] = {"s": round(now - self.last, 3), "peak_gb": None if peak is None else round(peak, 3)}
        self.last = now


def process_age_s() -> float | None:
    """Seconds since this process started (Linux's /proc), else None."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return round(uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"), 3)
    except (OSError, ValueError, IndexError):
        return None


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_generation(
    model,
    system,
    tokens,
    gen_tokens,
    stop,
    decode_mode,
    trace: Path | None = None,
    warmup: int = 0,
    kv_fill: str = "prefill",
    on_filled: Callable[[], None] | None = None,
    on_first_token: Callable[[], None] | None = None,
) -> Generation:
    """generate() with progress bars; with `trace`, the GPU kernels of one steady decode step (the first after
    the warm-up and a graph's capture) are written there as a Chrome trace (torch profiler; open in Perfetto)."""
    n_layers = model.cfg.num_layers
    # One bar at a time, so that a log (no terminal) does not interleave them: the decode bar opens once the KV is
    # filled, between the prefill's timing and the decode's.
    with contextlib.ExitStack() as bars, step_profiler(trace, warmup + 2) as prof:
        bar_p = bars.enter_context(
            tqdm(total=n_layers, desc=f"prefill {tokens.shape[1]} tokens", unit="layer", file=sys.stderr, leave=False)
        )
        bar_d = None

        def filled():
            nonlocal bar_d
            if on_filled is not None:
                on_filled()
            bar_p.close()
            bar_d = bars.enter_context(
                tqdm(total=gen_tokens - 1, desc="decode", unit="tok", file=sys.stderr, leave=False)
            )

        def on_token(_):
            if on_first_token is not None and bar_d.n == 0:
                on_first_token()
            bar_d.update(1)
            if prof is not None:
                prof.step()

        return generate(
            model,
            system,
            tokens,
            gen_tokens,
            stop,
            decode_mode,
            on_prefill_layer=lambda _: bar_p.update(1),
            on_token=on_token,
            kv_fill=kv_fill,
            on_filled=filled,
        )


@contextlib.contextmanager
def step_profiler(path: Path | None, skip: int):
    """A torch profiler that records the GPU kernels (on CPU runs: the operators) of the decode step after `skip`
    steps, then writes `path`."""
    if path is None:
        yield None
        return
    from torch.profiler import ProfilerActivity, profile, schedule

    path.parent.mkdir(parents=True, exist_ok=True)
    activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU  # CPU: its operators
    with profile(
        activities=[activity],
        schedule=schedule(wait=skip, warmup=1, active=1, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
    ) as prof:
        yield prof


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
