"""Whether a run fits, checked before any weight is loaded: the memory plan (weights, activations, the system's KV
on the device and in host memory) against the card, the budget (hardware.gpu_mem_gb) and the host's RAM. A run that
cannot fit is refused with the estimate and the ways out that would fit, instead of starting and dying from an
out-of-memory kill. The settings it reads are checked in experiments.runner.settings."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from kvoffload.errors import ConfigError
from kvoffload.kv.interface import GB, KVOffloadSystem, KVSpec
from kvoffload.model.config import ModelConfig
from kvoffload.offload.host import quantize_peak_bytes
from kvoffload.units import tokens_text


@dataclass
class MemoryPlan:
    weights: int
    activations: int
    kv_device: int
    kv_host: int
    kv_host_pinned: int  # what kv_host takes of the host's RAM: on CUDA its stores pinned, in torch's block sizes

    @property
    def device_total(self) -> int:
        return self.weights + self.activations + self.kv_device


# Beyond the tensors prefill_peak_bytes counts: library workspaces (cuBLAS, flash attention's log-sum-exp), the math
# path's scores where SDPA cannot take the causal offset itself (decoder.MASKED_SCORE_BYTES and its softmax), a
# system's chunked hash encoding, the allocator's rounding.
WORKSPACE_BYTES = 256 * 1024**2


def projection_peak_bytes(cfg: ModelConfig, rows: int, chunk_tokens: int, dtype_bytes: int) -> int:
    """A chunk's layer input through the norm and the projections, for `rows` rows (tokens x sequences) of
    `chunk_tokens` positions: the norm's fp32 temporaries, or h, the fused qkv and RoPE's temporaries."""
    hid, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, 2 * cfg.num_kv_heads * d
    norm = rows * hid * (8 + 2 * dtype_bytes)  # fp32 x, its square / the normed fp32, and the rounded result
    rope = 4 * chunk_tokens * d * (4 + dtype_bytes)  # the chunk's cos/sin, fp32 and rounded
    return max(norm, rows * (hid + q + kv + 3 * q) * dtype_bytes + rope)  # RoPE's three q-sized temporaries


def logits_bytes(cfg: ModelConfig, batch: int, dtype_bytes: int) -> int:
    return batch * cfg.vocab_size * (dtype_bytes + 4)


def prefill_peak_bytes(cfg: ModelConfig, seqlen: int, batch: int, dtype_bytes: int, chunk: int) -> int:
    """The most bytes of tensors Decoder.prefill holds at once, from the shapes alone. Through the layers: the
    residual stream x, the layer's K and V of the whole prompt, and one staged copy of them (the system's:
    CLO's head-permuted K/V held until its host copy is done, during the next layer's chunks on CUDA; the
    baselines' stacked K/V). Within a layer, one chunk of `chunk` tokens at its widest: the norm and the
    projections (projection_peak_bytes), q and the attention output with the causal mask of the CPU path, or the
    MLP (gate/up, SiLU(gate) and its product: the CPU reference's; CUDA's fused kernel needs one intermediate
    less). Then the last position's logits."""
    from kvoffload.model.chunk_attention import MASKED_ROWS

    t, c = batch * seqlen, batch * min(seqlen, chunk)
    hid, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, 2 * cfg.num_kv_heads * cfg.head_dim  # per token
    resident = t * (hid + 2 * kv) * dtype_bytes
    projections = projection_peak_bytes(cfg, c, min(seqlen, chunk), dtype_bytes)
    mask = 5 * min(seqlen, chunk, MASKED_ROWS) * seqlen  # bool mask and its float copy (off CUDA's flash path)
    attention = c * (3 * q + hid) * dtype_bytes + mask  # q, o and its flattened copy, o_proj's output
    mlp = min(seqlen, chunk) * (hid + 4 * inter) * dtype_bytes  # one sequence's chunk at a time
    return resident + max(projections, attention, mlp) + logits_bytes(cfg, batch, dtype_bytes)


def fill_peak_bytes(cfg: ModelConfig, seqlen: int, batch: int, dtype_bytes: int, chunk: int) -> int:
    """The most bytes of tensors Decoder.fill holds at once: the layer's K and V of the whole prompt and one staged
    copy of them (as prefill_peak_bytes), then one sequence's chunk of embeddings through the norm and the
    projections, or (kv_fill=key_process, after them) the chunk's fp32 draws and keys."""
    c, kv = min(seqlen, chunk), 2 * cfg.num_kv_heads * cfg.head_dim
    embeddings = c * cfg.hidden_size * dtype_bytes
    drawn = (
        c * kv // 2 * (16 + dtype_bytes)
    )  # experiments.workloads.key_process: draws, chain and scan temporaries (fp32), cast
    chunk_peak = max(embeddings + projection_peak_bytes(cfg, c, c, dtype_bytes), drawn)
    return batch * seqlen * 2 * kv * dtype_bytes + chunk_peak + logits_bytes(cfg, batch, dtype_bytes)


def activation_bytes(
    cfg: ModelConfig,
    seqlen: int,
    batch: int,
    dtype_bytes: int,
    chunk: int | None = None,
    kv_fill: str = "prefill",
) -> int:
    """Peak transient device memory of prefill (prefill_peak_bytes, plus WORKSPACE_BYTES); chunk: the run's
    prefill_chunk (None: the decoder's default). kv_fill=projection (Decoder.fill) counts the larger of the fill's
    own peak and one sequence's prefill: a decode batch that a server builds by prefilling its sequences one at a
    time, beside the batch's KV state, needs no more."""
    from kvoffload.model.decoder import PREFILL_CHUNK

    chunk = PREFILL_CHUNK if chunk is None else chunk
    if kv_fill in ("projection", "key_process"):
        peak = max(
            fill_peak_bytes(cfg, seqlen, batch, dtype_bytes, chunk),
            prefill_peak_bytes(cfg, seqlen, 1, dtype_bytes, chunk),
        )
    else:
        peak = prefill_peak_bytes(cfg, seqlen, batch, dtype_bytes, chunk)
    return peak + WORKSPACE_BYTES


def plan_memory(
    cfg: ModelConfig,
    system: KVOffloadSystem,
    spec: KVSpec,
    seqlen: int,
    chunk: int | None = None,
    kv_fill: str = "prefill",
) -> MemoryPlan:
    est = system.estimate_memory(spec)
    # an FP8 host store's rows are quantised on the offload stream while the next layer's prefill runs
    quantize = quantize_peak_bytes(spec.head_dim) if spec.fp8 else 0
    return MemoryPlan(
        weights=cfg.num_params * spec.dtype_bytes,
        activations=activation_bytes(cfg, seqlen, spec.batch, spec.dtype_bytes, chunk, kv_fill) + quantize,
        kv_device=est.device_bytes,
        kv_host=est.host_bytes,
        kv_host_pinned=system.pinned_host_bytes(spec) if spec.device.type == "cuda" else est.host_bytes,
    )


def host_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info.get("MemAvailable", info.get("MemFree", 0))


@dataclass
class Limits:
    """What a run may use: the host's available RAM and the device budget (None where none applies: a CPU run
    without hardware.gpu_mem_gb)."""

    device: torch.device
    host: int
    budget: int | None
    where: str = ""
    emulated: bool = False  # the budget is hardware.gpu_mem_gb (on a CPU run, or below what is free on a GPU)


def gb(n: float) -> str:
    """Bytes as GB for a message: one decimal from 1 GB up, two significant digits below (a 0.01 GB budget must
    not read "0.0")."""
    v = n / GB
    if v >= 0.995 or v == 0:  # from where two significant digits would round to "1"
        return f"{v:.1f}"
    return f"{v:.2g}" if v >= 1e-3 else "<0.001"


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device: the one place the preflight reads them (tests fake a device here)."""
    return torch.cuda.mem_get_info(device)


def memory_limits(device: torch.device, gpu_mem_gb: float | None) -> Limits:
    """The host's RAM and the device budget. A hardware.gpu_mem_gb above what the device has free is refused: the
    run would otherwise plan under less than it was asked to emulate."""
    host = host_available_bytes()
    if device.type == "cpu":
        if gpu_mem_gb is None:
            return Limits(device, host, None)
        return Limits(device, host, int(gpu_mem_gb * GB), "hardware.gpu_mem_gb", emulated=True)
    free, total = device_memory(device)
    where = f"{gb(free)} GB free of {gb(total)}"
    if gpu_mem_gb is None:
        return Limits(device, host, free, where)
    budget = int(gpu_mem_gb * GB)
    if budget > free:
        has = f"has free ({gb(free)} GB of {gb(total)})" if budget <= total else f"has ({gb(total)} GB)"
        raise ConfigError(
            f"hardware.gpu_mem_gb={gpu_mem_gb:g} is more than the GPU {has}: use at most "
            f"{math.floor(free / GB * 10) / 10:g}, or null for what is free"
        )
    return Limits(device, host, budget, f"hardware.gpu_mem_gb; {where}", emulated=budget < free)


def kv_budget(
    cfg: ModelConfig, spec: KVSpec, gpu_mem_gb: float | None, chunk: int | None = None, kv_fill: str = "prefill"
) -> int | None:
    """The device bytes a KV system may plan for: the budget less the weights and the prefill's activations
    (None where no budget applies). A system plans under it (CLO's persistent heads), so it is known before the
    system's estimate; check_memory then returns the same number for a run that fits. A budget that does not
    hold the weights is refused here: no batch, length or system would fit it."""
    limits = memory_limits(spec.device, gpu_mem_gb)
    if limits.budget is None:
        return None
    weights = cfg.num_params * spec.dtype_bytes
    if weights >= limits.budget:
        dtype = str(spec.dtype).removeprefix("torch.")
        bf16 = cfg.num_params * 2 < limits.budget and spec.dtype == torch.float32
        raise ConfigError(
            f"the budget is {gb(limits.budget)} GB ({limits.where}), less than {cfg.name}'s weights alone "
            f"({gb(weights)} GB in {dtype}), and it must also hold the prefill's activations and the KV: "
            + ("use dtype=bfloat16, " if bf16 else "")
            + ("a larger hardware.gpu_mem_gb" if gpu_mem_gb is not None else "a GPU with more free memory")
            + " or a smaller model"
        )
    fixed = weights + activation_bytes(cfg, spec.prompt_tokens, spec.batch, spec.dtype_bytes, chunk, kv_fill)
    return max(limits.budget - fixed, 0)


def shortfall(plan: MemoryPlan, limits: Limits) -> tuple[str, str] | None:
    """None when the plan fits; else (which memory is short, "host" or "device"; the sentence that says so)."""
    host_need = plan.kv_host_pinned + (plan.device_total if limits.device.type == "cpu" else 0)
    if host_need > limits.host:
        pinned = (
            f", its host stores pinned as {gb(plan.kv_host_pinned)} (torch pins in powers of two)"
            if plan.kv_host_pinned > plan.kv_host
            else ""
        )
        held = (  # a GPU run's RAM holds the KV's host stores; a CPU run's holds everything
            f"weights {gb(plan.weights)}, KV {gb(plan.kv_device + plan.kv_host)}{pinned}, activations "
            f"{gb(plan.activations)}"
            if limits.device.type == "cpu"
            else f"the KV's host stores {gb(plan.kv_host)}{pinned}"
        )
        return (
            "host",
            f"needs about {gb(host_need)} GB of RAM on this host ({held}) but {gb(limits.host)} GB is available",
        )
    if limits.budget is not None and plan.device_total > limits.budget:
        where = f" ({limits.where})" if limits.where else ""
        return "device", (
            f"needs about {gb(plan.device_total)} GB of GPU memory (weights {gb(plan.weights)}, KV "
            f"{gb(plan.kv_device)}, activations {gb(plan.activations)}) but the budget is "
            f"{gb(limits.budget)} GB{where}"
        )
    return None


def largest(fits: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """The largest n in [lo, hi] with fits(n), for fits true up to some n and false above it; None if none."""
    if hi < lo or not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


# A plan made before the device is measured holds these in place of the link, a layer's time and the budget: no
# system's host stores depend on the first two, and a budget of 0 leaves each its host stores at their least
# (tests/test_preflight.py checks every system), so the host's check before measuring never refuses a run that the
# full check, after the measurements, would let run. A system's least device share is not always at budget 0 (CLO
# at a top-k near 1 grows when it demotes a persistent head), so the budget is checked then only for a plan that
# keeps no host stores, whose device share depends on no measurement (FullAttn's).
UNMEASURED = {"link_gb_s": 1.0, "layer_time_s": 1e-3, "gpu_budget_bytes": 0}


def check_before_measuring(
    cfg: ModelConfig,
    system: KVOffloadSystem,
    spec: KVSpec,
    chunk: int | None,
    kv_fill: str,
    what: str,
    estimate: Callable[[KVSpec], MemoryPlan],
    gpu_mem_gb: float | None,
) -> None:
    """On CUDA, refuses before the device's context starts and the link and a layer are measured (`spec` holds
    UNMEASURED in their place) a run whose pinned host stores the host's RAM cannot hold, or that keeps all its KV
    on the device beyond hardware.gpu_mem_gb: a sweep's points beyond either end without a context. A budget below
    the weights is left to kv_budget's message; an offloading system's budget, the budget above the device's memory
    and the full check follow the measurements (check_memory), with the free memory in the message."""
    if spec.device.type != "cuda":  # a CPU run's RAM also holds what a GPU's memory would: the full check decides
        return
    plan = plan_memory(cfg, system, spec, spec.prompt_tokens, chunk, kv_fill)
    budget = None if gpu_mem_gb is None or plan.kv_host else int(gpu_mem_gb * GB)
    if budget is not None and budget <= plan.weights:
        budget = None
    limits = Limits(spec.device, host_available_bytes(), budget, "hardware.gpu_mem_gb", emulated=True)
    refuse_if_short(plan, limits, what, estimate, spec, cfg.name)


def ways_out(
    plan: MemoryPlan,
    limits: Limits,
    short: str,
    estimate: Callable[[KVSpec], MemoryPlan] | None,
    spec: KVSpec | None,
    model_name: str | None,
) -> str:
    """The ways out of a run that does not fit, for this system, device and shortage: first the changes that fit
    by the same estimate (bfloat16 instead of float32, the longest prompt, the largest batch), then the others."""
    fitting: list[str] = []
    if estimate is not None and spec is not None:

        def fits(sp: KVSpec) -> bool:
            try:
                return shortfall(estimate(sp), limits) is None
            except ConfigError:
                return False  # this variant is refused for another reason

        bases = [("", spec)]
        if spec.dtype == torch.float32:
            bf16 = replace(spec, dtype=torch.bfloat16)
            if fits(bf16):
                p = estimate(bf16)
                need = p.device_total  # of the memory that was short (a CPU run's RAM holds the device's share)
                if short == "host":
                    need = p.kv_host_pinned + (need if limits.device.type == "cpu" else 0)
                fitting.append(f"dtype=bfloat16 (about {gb(need)} GB)")
            else:  # neither alone: bfloat16 with a shorter prompt or a smaller batch may
                bases.append(("dtype=bfloat16 with ", bf16))
        for label, base in bases:
            gen = base.max_len - base.prompt_tokens
            n = largest(
                lambda t, base=base, gen=gen: fits(replace(base, max_len=t + gen, prompt_len=t)),
                1,
                base.prompt_tokens - 1,
            )
            if n is not None:
                fitting.append(f"{label}seqlen={tokens_text(n // 1024 * 1024 if n >= 1024 else n)} or shorter")
            b = largest(lambda b, base=base: fits(replace(base, batch=b)), 1, base.batch - 1)
            if b is not None:
                fitting.append(f"{label}batch={b}" + (" or smaller" if b > 1 else ""))
            if n is not None or b is not None:
                break
    other: list[str] = []
    if short == "device" and plan.kv_host == 0:
        other.append("an offloading system that keeps the KV on the host (system=clo, retroinfer or infinigen)")
    if model_name is not None and model_name != "smollm2":
        other.append("a smaller model (model=smollm2)")
    if short == "host":
        other.append("a machine with more RAM")
    elif limits.emulated:
        other.append("a larger hardware.gpu_mem_gb")
    else:
        other.append("a GPU with more free memory")
    if fitting:
        return f"Ways out that fit by this estimate: {', '.join(fitting)}. Or: {', '.join(other)}."
    return f"Ways out: {', '.join(other)}."


def check_memory(
    plan: MemoryPlan,
    device: torch.device,
    gpu_mem_gb: float | None,
    what: str,
    estimate: Callable[[KVSpec], MemoryPlan] | None = None,
    spec: KVSpec | None = None,
    model_name: str | None = None,
) -> int | None:
    """Refuses a run that cannot fit, with the ways out (estimate(spec) -> MemoryPlan re-plans a changed run, to
    say which changes would fit). Returns the KV system's device-memory budget in bytes, or None where no budget
    applies (a CPU run without hardware.gpu_mem_gb). On a CPU run, gpu_mem_gb emulates a card's memory."""
    limits = memory_limits(device, gpu_mem_gb)
    refuse_if_short(plan, limits, what, estimate, spec, model_name)
    return None if limits.budget is None else limits.budget - plan.weights - plan.activations


def refuse_if_short(
    plan: MemoryPlan,
    limits: Limits,
    what: str,
    estimate: Callable[[KVSpec], MemoryPlan] | None,
    spec: KVSpec | None,
    model_name: str | None,
) -> None:
    """The refusal of a plan that `limits` cannot hold: which memory is short, by how much, and the ways out."""
    short = shortfall(plan, limits)
    if short is not None:
        kind, sentence = short
        raise ConfigError(f"{what} {sentence}. {ways_out(plan, limits, kind, estimate, spec, model_name)}")
