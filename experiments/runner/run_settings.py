"""A run's settings checked before any weight is loaded: numbers and switches, the model's path, the output folders,
the device, dtypes and modes (the command line's keys and jobs: experiments.runner.cli_checks; whether the run fits
in memory: experiments.runner.preflight). Each bad value is a ConfigError naming the key and what is valid."""

from __future__ import annotations

import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvoffload.errors import ConfigError
from kvoffload.generate import DECODE_MODES, KV_FILLS
from kvoffload.kv.interface import KVOffloadSystem, check_kv_dtype
from kvoffload.model.config import ModelConfig
from kvoffload.units import parse_tokens


# ---- numbers and switches ------------------------------------------------------------------------------------
def integer(value: Any, key: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """A whole number from the config (an int, an integral float, or a string of digits), else a ConfigError."""
    n = None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        n = int(value)
    if n is None:
        raise ConfigError(f"{key}={value!r}: expected a whole number")
    if minimum is not None and n < minimum:
        raise ConfigError(f"{key}={n} must be at least {minimum}")
    if maximum is not None and n > maximum:
        raise ConfigError(f"{key}={n} must be at most {maximum}")
    return n


def number(
    value: Any,
    key: str,
    low: float | None = None,
    high: float | None = None,
    *,
    above: bool = False,
    null: bool = False,
) -> float | None:
    """A real number from the config, at least `low` (above it with above=True) and at most `high`; null: None
    is allowed."""
    if value is None and null:
        return None
    x = None
    if not isinstance(value, bool):
        try:
            x = float(value)
        except (TypeError, ValueError):
            pass
    if x is None or math.isnan(x):
        raise ConfigError(f"{key}={value!r}: expected a number" + (" or null" if null else ""))
    if low is not None and high is not None and not low <= x <= high:
        raise ConfigError(f"{key}={value!r} must lie in [{low:g}, {high:g}]")
    if low is not None and (x <= low if above else x < low):
        raise ConfigError(f"{key}={value!r} must be {'above' if above else 'at least'} {low:g}")
    if high is not None and x > high:
        raise ConfigError(f"{key}={value!r} must be at most {high:g}")
    return x


def switch(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r}: expected true or false")
    return value


_MISSING = object()
JOB_PROCESSES = ("inline", "fork", "fresh")  # where a sweep's job runs (experiments/runner/job_process.py)
MAX_PIN_THREADS = 128  # torch's pinned_num_register_threads limit


@dataclass(frozen=True)
class RunNumbers:
    seqlen: int
    batch: int
    seed: int
    gen_tokens: int
    warmup_steps: int
    needle_depth: float
    gpu_mem_gb: float | None
    hbm_gb_s: float | None
    prefill_chunk: int = 8192
    link_cap_gb_s: float | None = None  # hardware.link_gb_s
    kv_fill: str = "prefill"
    pin_threads: int = 0
    pin_huge_pages: bool = False
    job_process: str = "inline"


def check_decode_workload(cfg) -> None:
    """experiments.run decodes; the accuracy workload is experiments.accuracy's."""
    if cfg.workload.get("name") == "accuracy":
        raise ConfigError(
            "workload=accuracy runs lm-eval tasks: python -m experiments.accuracy [overrides] (docs/accuracy.md)"
        )


def weights_source(model_cfg) -> str:
    """Where a model's weights come from: "hf" when model.path is set, else model.weights."""
    return "hf" if model_cfg.get("path") else model_cfg.weights


def check_model_path(cfg) -> None:
    """A model.path checkpoint, checked before any work (its weights load only after the measurements): the folder,
    its config.json read and matched to the model's shapes, its safetensors files there."""
    if weights_source(cfg.model) != "hf":
        return
    from omegaconf import OmegaConf

    from kvoffload.model.weights import check_hf_folder

    model_cfg = ModelConfig.from_mapping(OmegaConf.to_container(cfg.model, resolve=True))
    check_hf_folder(model_cfg, Path(str(cfg.model.path)))


def check_kv_fill(cfg, kv_fill: str) -> None:
    """A KV filled without a prefill (projection, key process) is for synthetic weights, and the key process needs
    the model's synthetic_keys profile: bad input for every job of that model, refused before a sweep's first."""
    if kv_fill != "prefill" and weights_source(cfg.model) != "synthetic":
        raise ConfigError(f"workload.kv_fill={kv_fill} is for synthetic weights (speed runs); real weights prefill")
    if kv_fill == "key_process" and not cfg.model.get("synthetic_keys"):
        raise ConfigError(f"workload.kv_fill=key_process: model {cfg.model.name} has no synthetic_keys profile")


def check_numbers(cfg) -> RunNumbers:
    """Every top-level number and switch of a run, checked: one ConfigError naming the key and its value."""
    for key in ("force", "profile_phases", "workload.stop_at_eos", "wandb.enabled"):
        value = _select(cfg, key)
        if value is not _MISSING:
            switch(value, key)
    mode = _select(cfg, "wandb.mode")
    if mode is not _MISSING:  # W&B reads it only after the run: a typo would lose the run's log, found late
        from experiments.runner.wandb_log import MODES

        choice(mode, "wandb.mode", MODES)
    integer(cfg.get("repeat", 0), "repeat", 0)  # a label, checked: it names the run's folder
    hw = cfg.get("hardware") or {}
    threads = pin_threads(hw.get("pin_threads", 0), "hardware.pin_threads")
    huge = switch(hw.get("pin_huge_pages", False), "hardware.pin_huge_pages")
    if huge and not threads:
        raise ConfigError(
            "hardware.pin_huge_pages=true needs hardware.pin_threads > 0: huge pages apply to the malloc'd pages "
            "that threads touch and cudaHostRegister pins, not to cudaHostAlloc's"
        )
    return RunNumbers(
        seqlen=parse_tokens(cfg.seqlen, "seqlen"),
        batch=integer(cfg.batch, "batch", 1),
        seed=integer(cfg.seed, "seed", 0),
        gen_tokens=integer(cfg.workload.gen_tokens, "workload.gen_tokens", 1),
        warmup_steps=integer(cfg.workload.get("warmup_steps", 0), "workload.warmup_steps", 0),
        needle_depth=number(cfg.workload.get("needle_depth", 0.5), "workload.needle_depth", 0.0, 1.0),
        gpu_mem_gb=number(hw.get("gpu_mem_gb"), "hardware.gpu_mem_gb", 0.0, above=True, null=True),
        hbm_gb_s=number(hw.get("hbm_gb_s"), "hardware.hbm_gb_s", 0.0, above=True, null=True),
        link_cap_gb_s=number(hw.get("link_gb_s"), "hardware.link_gb_s", 0.0, above=True, null=True),
        prefill_chunk=parse_tokens(cfg.get("prefill_chunk", 8192), "prefill_chunk"),
        kv_fill=choice(cfg.workload.get("kv_fill", "prefill"), "workload.kv_fill", KV_FILLS),
        pin_threads=threads,
        pin_huge_pages=huge,
        job_process=choice(cfg.get("job_process", "inline"), "job_process", JOB_PROCESSES),
    )


def check_link_cap(cap_gb_s: float | None, device: torch.device, bulk_gb_s: float | None = None) -> None:
    """hardware.link_gb_s paces a GPU's link (kvoffload/offload/link.py): refused on a CPU run, which has no link, and
    above the bulk pinned copy rate measured at the start (bulk_gb_s; the link cannot be made faster than it is).
    Called with the device first (before the system is built), then with the measurement (before any allocation)."""
    if cap_gb_s is None:
        return
    if device.type != "cuda":
        raise ConfigError(
            f"hardware.link_gb_s={cap_gb_s:g} caps a GPU's host link; a {device.type} run has none: "
            "set hardware.link_gb_s=null, or run on a GPU"
        )
    if bulk_gb_s is not None and cap_gb_s > bulk_gb_s:
        raise ConfigError(
            f"hardware.link_gb_s={cap_gb_s:g} is above this link's bulk pinned copy, measured at "
            f"{bulk_gb_s:.2f} GB/s at the start of the run: a cap can only slow the link; use at most {bulk_gb_s:.2f}"
        )


def check_writable(path: Any, key: str, folder: bool = True) -> None:
    """A folder a run writes into (folder=False: a file, whose folder it writes into) must be one this process can
    create or write: its nearest existing part a folder it may write. Checked up front, since the record is
    written after the long work. Nothing is left behind (the probe folder is removed at once)."""
    target = Path(str(path))
    if folder and target.is_file():
        raise ConfigError(f"{key}={path} is a file, not a folder")
    if not folder and target.is_dir():
        raise ConfigError(f"{key}={path} is a folder, not a file")
    probe = target if folder else target.parent
    while not os.path.lexists(probe) and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        what = "a file" if probe.exists() else "a broken link"
        raise ConfigError(f"{key}={path}: {probe} is {what}, not a folder")
    try:  # a real write, not os.access: root passes that for folders it cannot write (/proc, a read-only mount)
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=probe))
    except OSError as e:
        raise ConfigError(f"{key}={path}: cannot write in {probe} ({e.strerror})") from None


def check_output_paths(cfg) -> None:
    """results_dir, and trace_dir and memory_snapshot where set: writable, before any work."""
    check_writable(cfg.results_dir, "results_dir")
    if cfg.get("trace_dir"):
        check_writable(cfg.trace_dir, "trace_dir")
    if cfg.get("memory_snapshot"):
        check_writable(cfg.memory_snapshot, "memory_snapshot", folder=False)


def pin_threads(value: Any, key: str) -> int:
    """0 or a power of two up to MAX_PIN_THREADS, as torch's pinned_num_register_threads takes them."""
    n = integer(value, key, 0, MAX_PIN_THREADS)
    if n & (n - 1):
        raise ConfigError(f"{key}={n}: expected 0 or a power of two (1, 2, 4, ... {MAX_PIN_THREADS})")
    return n


def choice(value: Any, key: str, valid: tuple[str, ...]) -> str:
    if value not in valid:
        raise ConfigError(f"{key}={value!r}; valid: {', '.join(valid)}")
    return value


def _select(cfg, key: str):
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, key, default=_MISSING)


def fp8_systems() -> list[str]:
    """The systems of conf/system/ whose class offers kv_dtype=fp8 (KVOffloadSystem.kv_dtypes), for messages."""
    from hydra.utils import get_class
    from omegaconf import OmegaConf

    from kvoffload.paths import ROOT

    names = []
    for path in sorted((ROOT / "conf" / "system").glob("*.yaml")):
        target = OmegaConf.load(path).get("_target_")
        if target and "fp8" in get_class(target).kv_dtypes:
            names.append(path.stem)
    return names


def kv_dtype(cfg, system: KVOffloadSystem, name: str) -> str:
    """cfg.kv_dtype, refused (before any allocation) where it is no KV_DTYPES value, the system does not offer it, or
    torch has no float8 (docs/fp8.md)."""
    value = cfg.get("kv_dtype", "model")
    check_kv_dtype(str(value), name, system.kv_dtypes, fp8_systems())
    return str(value)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device={name!r}; valid: auto, cpu, cuda, cuda:<index>") from None
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
        raise ConfigError(
            f"system {system.name} cannot be captured whole in a CUDA graph; use decode_mode=piecewise (or auto)"
        )
    if mode != "auto":
        return mode
    if device.type != "cuda":
        return "eager"
    return "graph" if system.supports_cuda_graph else "piecewise"


def check_length(cfg: ModelConfig, seqlen: int, gen_tokens: int) -> None:
    if seqlen + gen_tokens > cfg.max_position_embeddings:
        raise ConfigError(
            f"seqlen={seqlen} + gen_tokens={gen_tokens} exceeds {cfg.name}'s "
            f"max_position_embeddings={cfg.max_position_embeddings}"
        )
