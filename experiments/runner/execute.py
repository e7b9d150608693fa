"""One run of the decode workload in two halves: plan_run checks, builds and plans it without loading a weight
(every refusal happens there); run_plan loads the model, allocates, prefills, decodes and writes the record."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from experiments.runner import preflight, run_settings
from experiments.runner.generation import StageMarks, log, run_generation
from experiments.runner.records import config_error, environment
from experiments.runner.setting_types import check_system_settings
from experiments.runner.step_metrics import metrics, trace_phases
from experiments.runner.timing import copy_bandwidth_gb_s, link_gb_s, model_layer_time_s, paced_link
from experiments.workloads.prompts import PROMPTS, build_prompt
from kvoffload.errors import ConfigError
from kvoffload.kv.interface import GB, KVOffloadSystem, KVSpec
from kvoffload.kv.timer import PhaseTimer
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


@dataclass
class RunPlan:
    """Everything a run needs before its weights load: checked settings, the system built and planned under the
    budget, the measurements its plan read, the prompt. plan_run makes it; run_plan spends the long time on it."""

    cfg: DictConfig
    system_name: str
    what: str  # the run in one line, for messages
    numbers: run_settings.RunNumbers
    model_cfg: ModelConfig
    device: torch.device
    dtype: torch.dtype
    system: KVOffloadSystem
    spec: KVSpec
    plan: preflight.MemoryPlan
    decode_mode: str
    source: str  # the weights'
    query_process: Any
    key_process: Any
    tokenizer: Any
    prompt: Any
    link: float  # the measured bulk link, GB/s
    stages: StageMarks
    free_at_start: float | None


def execute(cfg: DictConfig, system_name: str) -> dict[str, Any]:
    return run_plan(plan_run(cfg, system_name))


def plan_run(cfg: DictConfig, system_name: str) -> RunPlan:
    """Every refusal comes from here, before any weight is loaded: the settings, then the system's plan under the
    host's RAM and the device budget, measured against the link and one layer's time."""
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
    return RunPlan(
        cfg, system_name, what, numbers, model_cfg, device, dtype, system, spec, plan, decode_mode, source,
        query_process, key_process, tokenizer, prompt, link, stages, free_at_start,
    )  # fmt: skip


def run_plan(p: RunPlan) -> dict[str, Any]:
    """The long work: the weights, the system's allocation, the prefill and the decode; then the record."""
    cfg, numbers, model_cfg, device, system, stages = p.cfg, p.numbers, p.model_cfg, p.device, p.system, p.stages
    fill = numbers.kv_fill
    query_desc = p.query_process.description if p.query_process is not None else "the model's own queries"
    keys_desc = p.key_process.description if p.key_process is not None else None
    keys_line = f"; keys: {keys_desc}" if keys_desc else ""  # else the model's own keys, from its prefill
    log(f"[run] {p.what} on {device} ({p.dtype}); loading {p.source} weights; queries: {query_desc}{keys_line}")
    hbm = numbers.hbm_gb_s or copy_bandwidth_gb_s(device)
    cap = numbers.link_cap_gb_s
    unpaced = {"cap_gb_s": None, "bulk_unpaced_gb_s": round(p.link, 2) if device.type == "cuda" else None}
    link_record = paced_link(device, cap, p.link) if cap is not None else unpaced
    stages.mark("measure")  # the link, HBM, one layer's time, the plan, the prompt: all before the weights load
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # the record's peak is the run's, not its measurements' buffers
    snapshot = Path(cfg.memory_snapshot) if cfg.get("memory_snapshot") and device.type == "cuda" else None
    if snapshot is not None:
        torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=2_000_000)
    model, weights_desc = build_decoder(model_cfg, p.source, cfg.model.get("path"), numbers.seed, device, p.dtype)
    stages.mark("weights")
    model.query_process, model.key_process = p.query_process, p.key_process
    model.prefill_chunk = numbers.prefill_chunk
    # Events cannot time phases inside a replayed graph: graph runs time whole steps only.
    timer = PhaseTimer(device, enabled=bool(cfg.profile_phases) and p.decode_mode != "graph")
    system.allocate(p.spec, timer)  # refuses a KV plan that does not fit the budget
    stages.mark("allocate")
    # the process's memory on huge pages once its stores are pinned (by threads; CUDA only: a CPU run pins nothing)
    huge_gb = anon_huge_gib() if numbers.pin_threads and device.type == "cuda" else None
    tokenizer = p.tokenizer
    stop = {tokenizer.eos_token_id} if tokenizer is not None and cfg.workload.stop_at_eos else set()
    trace = Path(cfg.trace_dir) / "decode_step.trace.json" if cfg.get("trace_dir") else None
    gen = run_generation(
        model,
        system,
        p.prompt.tokens.to(device),
        numbers.gen_tokens,
        stop,
        p.decode_mode,
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
    prompt = p.prompt
    return {
        "system": p.system_name,
        "model": model_cfg.name,
        "weights": weights_desc,
        "seqlen": numbers.seqlen,
        "batch": numbers.batch,
        "decode_mode": p.decode_mode,
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
            "device_free_gb_at_start": p.free_at_start,
            "process_huge_pages_gb_after_allocate": huge_gb,
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        },
        "metrics": metrics(
            gen, system, model_cfg, p.spec, numbers.seqlen, hbm, state.get("link_gb_s"), numbers.warmup_steps, fill
        ),
        "system_state": state,
        "link": link_record,  # hardware.link_gb_s: the cap, its mechanism, the rates it let through
        "memory_plan_gb": {k: round(v / GB, 3) for k, v in p.plan.__dict__.items()},
        "stages": stages.marks,
        # a graph-replayed step's phases, read from the traced step's kernels (experiments.runner.trace_phases)
        "trace_phase_ms": trace_phases(trace),
        "steps": [s.as_dict() for s in gen.steps],
    }


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
