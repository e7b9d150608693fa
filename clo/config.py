"""CLO's settings (conf/system/clo.yaml), typed and validated once, before any long work."""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvoffload.errors import ConfigError
from kvoffload.kernels.head_cache import AGGREGATIONS
from kvoffload.offload.budget import check_budget
from kvoffload.offload.retrieval import RETRIEVERS, check_hash_weights, check_topk_method
from kvoffload.offload.transfer import TRANSFERS, cpu_threads

# which query selects a persistent head's top-k rows: the layer's real query, on the critical path
# (docs/systems.md, "Speculative query": persistent heads "run top-k there"), or the speculative one, one layer ahead
# with the other heads' selection (as the prefetch heads select theirs); attention always uses the real query
PERSIST_QUERIES = ("real", "speculative")


def _one_of(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ConfigError(f"{name}={value!r}; valid: {', '.join(valid)}")


def _positive_or_none(name: str, value: float | None) -> None:
    if value is not None and not value > 0:
        raise ConfigError(f"{name}={value} must be positive, or null (measured by the runner)")


@dataclass(frozen=True)
class CLOConfig:
    topk_ratio: float = 0.1  # top-k budget as a fraction of the prompt (sink and recent count in it)
    sink: int = 16
    recent: int = 64
    dense_layers: int = 2  # leading layers kept dense
    retriever: str = "hash"  # hash (HATA) | exact (oracle) | pq (product quantisation)
    rbit: int = 256  # hash bits per key
    seed: int = 0  # of the hash projections (SimHash)
    hash_weights: str | None = None  # learned projections (experiments.producers.train_hata); None: SimHash
    eta: float = 0.8  # the strictest reuse threshold (Eq. 7)
    n: float = 3.0  # the importance exponent of Eq. 8
    adaptive_threshold: bool = True  # +T; false: tau = eta everywhere
    gqa_aggregation: str = "mean"  # +G: mean (Eq. 10) | min
    threshold_override: float | None = None  # a number forces tau everywhere (2: always miss, -2: always hit)
    importance: str = "uniform"  # head importance scores (data/head_importance/<name>) or uniform
    profile: str = "none"  # reuse profile (s_hat per head) or none
    epsilon: float = 0.1  # Eq. 11's margin
    persistent: bool = True  # +P: persistent heads and speculative prefetch of the hard heads
    speculative: bool = True  # one-layer-ahead lookup, retrieval and transfer with the speculative query
    layer_time_ms: float | None = None  # T_comp of Eq. 12; None: the runner's measurement (KVSpec)
    link_gb_s: float | None = None  # B_PCIe of Eq. 12; None: the runner's measurement (KVSpec)
    transfer: str = "uva"  # uva (GPU-initiated gather) | cpu_gather (CPU threads + async copy)
    cpu_threads: int | str = 4  # cpu_gather's threads, or auto
    uva_programs: int | None = 32  # programs of the UVA gather (None: one per tile of each (sequence, head))
    topk: str = "radix"  # radix (exact radix select on CUDA) | torch (torch.topk)
    persist_query: str = "real"  # PERSIST_QUERIES

    def __post_init__(self) -> None:
        check_budget(self.topk_ratio, self.sink, self.recent, self.dense_layers)
        if not -1.0 < self.eta <= 1.0:
            raise ConfigError(f"eta={self.eta} must lie in (-1, 1]")
        if not self.n > 0:
            raise ConfigError(f"n={self.n} must be positive")
        if not -2.0 <= self.epsilon <= 2.0:
            raise ConfigError(f"epsilon={self.epsilon} must lie in [-2, 2] (a margin on a cosine)")
        if self.threshold_override is not None and not -2.0 <= self.threshold_override <= 2.0:
            raise ConfigError(
                f"threshold_override={self.threshold_override} must lie in [-2, 2] "
                "(a cosine threshold: 2 always misses, -2 always hits), or null"
            )
        if self.rbit < 8 or self.rbit % 8:
            raise ConfigError(f"rbit={self.rbit} must be a positive multiple of 8")
        _one_of("gqa_aggregation", self.gqa_aggregation, AGGREGATIONS)
        _one_of("retriever", self.retriever, RETRIEVERS)
        check_hash_weights(self.hash_weights, self.retriever)
        _one_of("transfer", self.transfer, TRANSFERS)
        _one_of("persist_query", self.persist_query, PERSIST_QUERIES)
        check_topk_method(self.topk)
        cpu_threads(self.cpu_threads)
        if self.uva_programs is not None and self.uva_programs < 1:
            raise ConfigError(f"uva_programs={self.uva_programs} must be at least 1, or null")
        _positive_or_none("layer_time_ms", self.layer_time_ms)
        _positive_or_none("link_gb_s", self.link_gb_s)
        if self.persist_query == "speculative" and self.persistent and not self.speculative:
            raise ConfigError("persist_query=speculative selects one layer ahead: it needs speculative=true")

    @classmethod
    def from_settings(cls, settings: dict) -> CLOConfig:
        """From the yaml's keys, refusing one CLO does not have (a typo would otherwise run the default)."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(settings) - set(known))
        if unknown:
            raise ConfigError(f"{unknown[0]}: CLO has no such setting; valid: {', '.join(known)}")
        return cls(**settings)
