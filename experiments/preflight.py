"""Checks that run before any weight is loaded: sequence length, memory. A run that cannot fit is refused with
the estimate and a way out, instead of starting and dying from an out-of-memory kill."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from kvoffload.errors import ConfigError
from kvoffload.generate import DECODE_MODES
from kvoffload.kv.interface import GB, KVOffloadSystem, KVSpec
from kvoffload.model.config import ModelConfig

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")


def parse_tokens(value: int | str, what: str = "seqlen") -> int:
    """4096, '4096', '4k', '128K', '1m' -> tokens (k = 1024, m = 1024**2)."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = _SIZE.match(str(value))
        if not m:
            raise ConfigError(f"{what}={value!r}: expected a token count such as 4096, 32k, 128k or 1m")
        n = int(float(m.group(1)) * {"": 1, "k": 1024, "m": 1024**2}[m.group(2).lower()])
    if n < 1:
        raise ConfigError(f"{what}={value!r} must be at least 1 token")
    return n


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name} but CUDA is not available here; use device=auto or device=cpu")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    valid = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if name not in valid:
        raise ConfigError(f"dtype={name!r}; valid: auto, {', '.join(valid)}")
    return valid[name]


def resolve_decode_mode(mode: str, device: torch.device, system: KVOffloadSystem) -> str:
    """eager, graph (the whole step in one CUDA graph) or piecewise (only the model's dense work in graphs, for
    systems that talk to the host inside a step). auto: on CUDA graph when the system supports it, else
    piecewise; eager on the CPU."""
    if mode not in ("auto", *DECODE_MODES):
        raise ConfigError(f"decode_mode={mode!r}; valid: auto, {', '.join(DECODE_MODES)}")
    if mode in ("graph", "piecewise") and device.type != "cuda":
        raise ConfigError(f"decode_mode={mode} needs CUDA; use decode_mode=eager or auto on the CPU")
    if mode == "graph" and not system.supports_cuda_graph:
        raise ConfigError(f"system {system.name} cannot be captured whole in a CUDA graph; "
                          f"use decode_mode=piecewise (or auto)")
    if mode != "auto":
        return mode
    if device.type != "cuda":
        return "eager"
    return "graph" if system.supports_cuda_graph else "piecewise"


def check_length(cfg: ModelConfig, seqlen: int, gen_tokens: int) -> None:
    if seqlen + gen_tokens > cfg.max_position_embeddings:
        raise ConfigError(f"seqlen={seqlen} + gen_tokens={gen_tokens} exceeds {cfg.name}'s "
                          f"max_position_embeddings={cfg.max_position_embeddings}")


@dataclass
class MemoryPlan:
    weights: int
    activations: int
    kv_device: int
    kv_host: int

    @property
    def device_total(self) -> int:
        return self.weights + self.activations + self.kv_device


def activation_bytes(cfg: ModelConfig, seqlen: int, batch: int, dtype_bytes: int) -> int:
    """Peak transient memory of prefill: the residual stream, q/k/v/attention output of one layer, one MLP chunk
    (8192 tokens) and the final logits. A generous estimate, not a measurement."""
    from kvoffload.model.decoder import PREFILL_CHUNK

    t = batch * seqlen
    per_token = cfg.hidden_size * 3 + (cfg.num_heads * 2 + cfg.num_kv_heads * 2) * cfg.head_dim
    mlp = batch * min(seqlen, PREFILL_CHUNK) * cfg.intermediate_size * 3
    return (t * per_token + mlp) * dtype_bytes + batch * cfg.vocab_size * 4 + 256 * 1024**2


def plan_memory(cfg: ModelConfig, system: KVOffloadSystem, spec: KVSpec, seqlen: int) -> MemoryPlan:
    est = system.estimate_memory(spec)
    return MemoryPlan(
        weights=cfg.num_params * spec.dtype_bytes,
        activations=activation_bytes(cfg, seqlen, spec.batch, spec.dtype_bytes),
        kv_device=est.device_bytes,
        kv_host=est.host_bytes,
    )


def host_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info.get("MemAvailable", info.get("MemFree", 0))


def check_memory(plan: MemoryPlan, device: torch.device, gpu_mem_gb: float | None, what: str) -> int | None:
    """Refuses a run that cannot fit. Returns the KV system's device-memory budget in bytes, or None where no
    budget applies (a CPU run without hardware.gpu_mem_gb). On a CPU run, gpu_mem_gb emulates a card's memory."""
    way_out = ("Ways out: a shorter seqlen, a smaller batch, a smaller model (model=smollm2), "
               "an offloading system instead of fullattn, or a machine with more memory.")
    host = host_available_bytes()
    host_need = plan.kv_host + (plan.device_total if device.type == "cpu" else 0)
    if host_need > host:
        raise ConfigError(f"{what} needs about {host_need / GB:.1f} GB of RAM on this host (weights "
                          f"{plan.weights / GB:.1f}, KV {(plan.kv_device + plan.kv_host) / GB:.1f}, activations "
                          f"{plan.activations / GB:.1f}) but {host / GB:.1f} GB is available. {way_out}")
    if device.type == "cpu":
        if gpu_mem_gb is None:
            return None
        budget, where = int(gpu_mem_gb * GB), "hardware.gpu_mem_gb"
    else:
        free, total = torch.cuda.mem_get_info(device)
        budget = free if gpu_mem_gb is None else min(int(gpu_mem_gb * GB), free)
        where = f"{free / GB:.1f} GB free of {total / GB:.1f}"
    if plan.device_total > budget:
        raise ConfigError(f"{what} needs about {plan.device_total / GB:.1f} GB of GPU memory (weights "
                          f"{plan.weights / GB:.1f}, KV {plan.kv_device / GB:.1f}, activations "
                          f"{plan.activations / GB:.1f}) but the budget is {budget / GB:.1f} GB ({where}). {way_out}")
    return budget - plan.weights - plan.activations
