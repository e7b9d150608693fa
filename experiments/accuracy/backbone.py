"""The model side of an accuracy run, built once and shared by every system that is evaluated in one process: the
decoder with its weights, the tokenizer, the runner's measurements that systems plan with, and the prompts'
prefills. Prefill is dense attention over the prompt whatever the system (a system only receives each layer's K/V),
so a prompt's prefill is computed once and handed to each system in turn (`PrefillCache`)."""

from __future__ import annotations

import ctypes
import sys
import time
from dataclasses import dataclass, field, replace

import torch
from omegaconf import DictConfig, OmegaConf

from experiments.runner import preflight, run_settings
from experiments.runner.execute import build_system, load_tokenizer
from experiments.runner.run_settings import weights_source
from experiments.runner.timing import link_gb_s, model_layer_time_s
from kvoffload.errors import ConfigError
from kvoffload.generate import sync_device
from kvoffload.kv.interface import GB, KVOffloadSystem, KVSpec
from kvoffload.kv.timer import PhaseTimer
from kvoffload.model.config import ModelConfig
from kvoffload.model.rope import rope_frequencies
from kvoffload.model.weights import build_decoder


@dataclass
class Prefill:
    """One prompt's prefill: the last position's logits [1, V] and every layer's K/V [1, Hkv, T, D]."""

    logits: torch.Tensor
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    seconds: float

    @property
    def tokens(self) -> int:
        return self.k[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def load_into(self, system: KVOffloadSystem) -> None:
        """Hands the K/V to `system` as the decoder's prefill would (copies: a system may keep what it is given)."""
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            system.prefill(layer, k.clone(), v.clone())
        system.end_prefill(self.tokens)


class PrefillRecorder(KVOffloadSystem):
    """Receives the decoder's prefill and keeps each layer's K/V; decodes nothing."""

    name = "prefill-recorder"

    def __init__(self) -> None:
        super().__init__()
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def estimate_parts(self, spec: KVSpec) -> dict[str, int]:
        return {"kv": 0, "host": 0}

    def memory_parts(self) -> dict[str, int]:
        return {"kv": sum(t.numel() * t.element_size() for t in (*self.k, *self.v)), "host": 0}

    def _allocate(self, spec: KVSpec) -> None:
        pass

    def prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k.append(k)
        self.v.append(v)

    def decode(self, layer, q, k, v):
        raise RuntimeError("PrefillRecorder only records a prefill")


@dataclass
class PrefillCache:
    """Prefills by prompt, up to max_bytes of K/V, the least recently used evicted first, but never one the current
    job (begin_job) has used. The accuracy bundles run a cell's systems one after another (cell-major), each system
    over the cell's prompts in order, so a cell's prompts are met again right away and an older cell's never:
    keeping the first prompts instead would fill the cache with the first cells and miss on every later one. When a
    cell's prompts do not all fit, plain LRU would evict each prompt just before the next system asks for it; keeping
    what this job used and passing the rest by leaves the next system the first ones."""

    max_bytes: int
    entries: dict[tuple[int, ...], Prefill] = field(default_factory=dict)  # least recently used first
    used: int = 0
    hits: int = 0
    misses: int = 0
    job: int = 0
    last_job: dict[tuple[int, ...], int] = field(default_factory=dict)  # the job that last used each entry

    def begin_job(self) -> None:
        self.job += 1

    def get(self, ids: tuple[int, ...]) -> Prefill | None:
        p = self.entries.pop(ids, None)
        if p is not None:
            self.entries[ids] = p  # now the most recently used
            self.last_job[ids] = self.job
        self.hits += p is not None
        self.misses += p is None
        return p

    def clear(self) -> None:
        """Drops every entry (a run that needs the memory comes before the saved recomputation)."""
        self.entries.clear()
        self.last_job.clear()
        self.used = 0

    def put(self, ids: tuple[int, ...], p: Prefill) -> None:
        if p.nbytes > self.max_bytes:
            return
        while self.used + p.nbytes > self.max_bytes:
            oldest = next(iter(self.entries))
            if self.last_job[oldest] == self.job:
                return  # every entry serves this job: this prefill passes the cache by
            self.used -= self.entries.pop(oldest).nbytes
            del self.last_job[oldest]
        self.entries[ids] = p
        self.last_job[ids] = self.job
        self.used += p.nbytes


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def fix_mmap_threshold(nbytes: int = 1 << 20) -> bool:
    """Keep every host block of nbytes or more in a mapping of its own, returned to the system when freed. glibc's
    default raises this threshold to the size of each large block freed (up to 32 MB); from then on blocks of a
    layer's K/V size come from the heap, and a cache that frees them in another order than it took them (the
    PrefillCache evicting its oldest prompt while the next is computed) leaves the heap fragmented: an 8K sweep's
    process held far more than its cache. True where the setting took (glibc on Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, nbytes) == 1
    except (OSError, AttributeError):  # another C library
        return False


class Backbone:
    """Decoder, tokenizer and measurements from a composed config (its model, device, dtype and seed)."""

    def __init__(self, cfg: DictConfig, real_weights: bool = True):
        """real_weights=False admits synthetic weights and no tokenizer (a test of a path's numerics on token ids)."""
        self.cfg = cfg
        self.model_cfg = ModelConfig.from_mapping(OmegaConf.to_container(cfg.model, resolve=True))
        self.device = run_settings.resolve_device(cfg.device)
        self.dtype = run_settings.resolve_dtype(cfg.dtype, self.device)
        self.source = weights_source(cfg.model)
        if self.source == "synthetic" and real_weights:
            raise ConfigError(f"model={self.model_cfg.name} has synthetic weights: accuracy needs real ones")
        self.tokenizer = load_tokenizer(self.source, cfg.model)
        if self.tokenizer is None and real_weights:
            raise ConfigError(f"model={self.model_cfg.name}: no tokenizer files next to its weights")
        gb = cfg.workload.get("prefill_cache_gb", 0) or 0
        self.cache = PrefillCache(int(run_settings.number(gb, "workload.prefill_cache_gb", 0.0) * GB))
        if self.cache.max_bytes and self.device.type == "cpu":
            fix_mmap_threshold()
        # Eq. 12's inputs: measured here unless the workload pins them (a loaded machine's layer time would change
        # CLO's plan, and with it what the fidelity of one setting means)
        pinned_link = run_settings.number(
            cfg.workload.get("link_gb_s"), "workload.link_gb_s", 0.0, above=True, null=True
        )
        pinned_ms = run_settings.number(
            cfg.workload.get("layer_time_ms"), "workload.layer_time_ms", 0.0, above=True, null=True
        )
        self.link_gb_s = pinned_link or link_gb_s(self.device)
        self.layer_time_s = (
            pinned_ms / 1e3 if pinned_ms else model_layer_time_s(self.model_cfg, 1, self.device, self.dtype)
        )
        self.plan_inputs = {
            "link_gb_s": self.link_gb_s,
            "layer_time_ms": round(self.layer_time_s * 1e3, 6),
            "pinned": {"link_gb_s": pinned_link is not None, "layer_time_ms": pinned_ms is not None},
        }
        seed = run_settings.integer(cfg.seed, "seed", 0)
        self.model, self.weights = build_decoder(
            self.model_cfg, self.source, cfg.model.get("path"), seed, self.device, self.dtype
        )

    @staticmethod
    def key(cfg: DictConfig) -> str:
        """What the backbone depends on: two configs with the same key share one."""
        return repr(
            (
                OmegaConf.to_container(cfg.model, resolve=True),
                cfg.device,
                cfg.dtype,
                cfg.seed,
                cfg.workload.get("prefill_cache_gb"),
                cfg.workload.get("link_gb_s"),
                cfg.workload.get("layer_time_ms"),
            )
        )

    def prefill(self, ids: list[int]) -> tuple[Prefill, bool]:
        """The prompt's prefill and whether it was computed earlier (for another system)."""
        key = tuple(ids)
        hit = self.cache.get(key)
        if hit is not None:
            return hit, True
        rec = PrefillRecorder()
        tokens = torch.tensor([ids], dtype=torch.long, device=self.device)
        sync_device(self.device)
        t0 = time.perf_counter()
        logits = self.model.prefill(tokens, rec)
        sync_device(self.device)
        p = Prefill(logits, rec.k, rec.v, time.perf_counter() - t0)
        self.cache.put(key, p)
        return p, False

    def all_logits(self, ids: list[int]) -> torch.Tensor:
        """Logits at every position [T, V] of a dense forward pass (no system involved)."""
        tokens = torch.tensor([ids], dtype=torch.long, device=self.device)
        return self.model.prefill(tokens, PrefillRecorder(), all_logits=True)[0]

    def system(
        self,
        system_cfg: DictConfig,
        name: str,
        prompt_len: int,
        max_new: int,
        batch: int = 1,
        layer_time_s: float | None = None,
    ) -> KVOffloadSystem:
        """A fresh system planned and allocated for one request, or `batch` of one length (its plan depends on the
        prompt's length); layer_time_s: the layer time it plans with, when not the backbone's."""
        m, numbers = self.model_cfg, self.cfg.get("hardware") or {}
        gpu_mem_gb = run_settings.number(numbers.get("gpu_mem_gb"), "hardware.gpu_mem_gb", 0.0, above=True, null=True)
        system = build_system(system_cfg, name)
        kv_dtype = run_settings.kv_dtype(self.cfg, system, name)  # the host stores' format (docs/fp8.md)
        spec = KVSpec(
            m.num_layers,
            batch,
            prompt_len + max_new,
            m.num_heads,
            m.num_kv_heads,
            m.head_dim,
            self.dtype,
            self.device,
            prompt_len=prompt_len,
            rope_inv_freq=rope_frequencies(m),
            link_gb_s=self.link_gb_s,
            layer_time_s=layer_time_s or self.layer_time_s,
            kv_dtype=kv_dtype,
        )
        spec = replace(spec, gpu_budget_bytes=preflight.kv_budget(m, spec, gpu_mem_gb))
        plan = preflight.plan_memory(m, system, spec, prompt_len)
        what = f"system={name} model={m.name} {batch} prompt(s) of {prompt_len} tokens"
        preflight.check_memory(plan, self.device, gpu_mem_gb, what, model_name=m.name)
        system.allocate(spec, PhaseTimer(self.device))
        return system


_LAST: tuple[str, Backbone] | None = None


def backbone_for(cfg: DictConfig) -> Backbone:
    """The backbone for cfg, reused when the previous call had the same key (the jobs of one sweep)."""
    global _LAST
    key = Backbone.key(cfg)
    if _LAST is None or _LAST[0] != key:
        _LAST = None  # the old one's memory goes first
        _LAST = (key, Backbone(cfg))
    return _LAST[1]
