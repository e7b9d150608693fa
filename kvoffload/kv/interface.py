"""KVOffloadSystem: the one seam between the decoder and a KV-cache policy.

The decoder calls, per layer:
  prefill(layer, k, v)          once, with the whole prompt's post-RoPE K/V            [B, Hkv, T, D]
  prepare(layer, q_spec)        during layer-1 of a decode step, with a speculative query [B, Hq, D]
                                (only when `wants_speculative_query`)
  decode(layer, q, k, v) -> o   appends the new token's K/V [B, Hkv, D] and attends      [B, Hq, D]
and, per step, begin_step() / end_step(). A system never sees the model, the model never sees the system's
internals: they share shapes (KVSpec) and statistics (StepStats) only.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field

import torch

from kvoffload.errors import ConfigError
from kvoffload.kernels.fp8_rows import SCALE_BYTES, fp8_dtype, packed_width
from kvoffload.kv.timer import PhaseTimer

GB = 1024**3
# kv_dtype: how an offloading system's host store holds its rows (docs/fp8.md). model: the model's dtype, as the
# device does; fp8: FP8 e4m3 with an fp16 scale per token, KV head and half (kvoffload/kernels/fp8_rows.py)
KV_DTYPES = ("model", "fp8")
# CUDA's native e4m3 conversions (Ada, Hopper); below it the fp8 attention kernel decodes the bits with integer ops
FP8_NATIVE_CAPABILITY = (8, 9)
# the link a CPU run plans and reports with: hardware.md's UVA gather of scattered rows on the H200 machine
CPU_LINK_GB_S = 49.6


@dataclass(frozen=True)
class KVSpec:
    num_layers: int
    batch: int
    max_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    gpu_budget_bytes: int | None = None  # None: no budget set (CPU runs, or the whole device)
    layer_time_s: float | None = None  # measured time of one decoder layer's dense compute at this batch
    # the prompt's length when known: memory estimates then count the generated tokens a system keeps on the
    # device; None assumes a prompt of max_len tokens (no generated rows)
    prompt_len: int | None = None
    # host->device bandwidth (GB/s = 1e9 B/s) that systems plan with and divide their moved bytes by, measured by
    # the runner (experiments.runner.timing.link_gb_s); None: CPU_LINK_GB_S on a CPU run, refused on CUDA
    link_gb_s: float | None = None
    # hardware.link_gb_s: a cap every transfer path is paced to (kvoffload.offload.link); the runner then hands the
    # cap as link_gb_s too, so that plans and floors use it. None: the real link, unpaced
    link_cap_gb_s: float | None = None
    # the model's rotary frequencies [D/2] (kvoffload.model.rope.rope_frequencies), for a system that keeps keys
    # without their rotation and rotates them again at their positions (ShadowKV-style's low-rank pre-RoPE keys):
    # prefill hands over post-RoPE keys only. None: not handed over (a system that needs them refuses the run)
    rope_inv_freq: tuple[float, ...] | None = None
    # the host store's format (KV_DTYPES): what every offloaded row moved and attended is; the window, dense layers
    # and persistent heads stay in `dtype`
    kv_dtype: str = "model"

    @property
    def prompt_tokens(self) -> int:
        return self.max_len if self.prompt_len is None else self.prompt_len

    @property
    def link_bytes_per_s(self) -> float:
        if self.link_gb_s is not None:
            return self.link_gb_s * 1e9
        if self.device.type == "cuda":
            raise ConfigError(
                "KVSpec.link_gb_s is not set: on CUDA the runner measures the link "
                "(experiments.runner.timing.link_gb_s) and hands it to the system"
            )
        return CPU_LINK_GB_S * 1e9

    @property
    def row_bytes(self) -> int:
        """K and V of one token of one KV head: the unit every offloading system moves and attends."""
        return 2 * self.head_dim * self.dtype_bytes

    @property
    def fp8(self) -> bool:
        return self.kv_dtype == "fp8"

    @property
    def host_dtype(self) -> torch.dtype:
        """The element type of a host store and of the device buffers its rows land in (packed bytes under fp8)."""
        return torch.uint8 if self.fp8 else self.dtype

    @property
    def host_width(self) -> int:
        """The last dimension of a host row's half (K or V): head_dim, or its packed bytes under fp8."""
        return packed_width(self.head_dim) if self.fp8 else self.head_dim

    @property
    def host_row_bytes(self) -> int:
        """An offloaded row (K and V of one token of one KV head, with its scales under fp8): the unit the host stores
        hold and the link moves, that plans (CLO's Eq. 12), floors and the host-memory checks count."""
        return 2 * (self.head_dim + SCALE_BYTES) if self.fp8 else self.row_bytes

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def layer_kv_bytes(self) -> int:
        """Full-length K+V bytes of one layer."""
        return 2 * self.batch * self.num_kv_heads * self.max_len * self.head_dim * self.dtype_bytes


def check_kv_dtype(kv_dtype: str, system: str, supported: tuple[str, ...], offering: list[str] | None = None) -> None:
    """Refuses, before anything is allocated, a kv_dtype that is not one of KV_DTYPES, one the system does not offer
    (`supported`: its kv_dtypes; `offering`: the systems that offer fp8, for the message), or fp8 where torch has no
    float8 dtype. Any CUDA device will do: below compute
    capability 8.9 (FP8_NATIVE_CAPABILITY) the attention kernel decodes e4m3 bits with integer ops, and torch's
    quantising casts are elementwise kernels on every device."""
    fp8 = f"fp8 (system={', '.join(offering)})" if offering else "fp8 (an offloading system)"
    if kv_dtype not in KV_DTYPES:
        raise ConfigError(f"kv_dtype={kv_dtype!r}; valid: model (every system), {fp8}")
    if kv_dtype not in supported:
        raise ConfigError(
            f"kv_dtype={kv_dtype} with system={system}, which keeps no KV in host memory: fp8 quantises host stores "
            f"only. Valid: kv_dtype=model (every system), kv_dtype={fp8}"
        )
    if kv_dtype == "fp8" and fp8_dtype() is None:
        raise ConfigError(f"kv_dtype=fp8 needs torch.float8_e4m3fn, which torch {torch.__version__} lacks")


@dataclass
class MemoryEstimate:
    device_bytes: int  # on the accelerator (on a CPU run, the same RAM as host_bytes)
    host_bytes: int  # pinned or plain host memory


def split_host(parts: dict[str, int]) -> MemoryEstimate:
    """A system's memory parts (bytes by name) -> device and host totals: the parts named host* are host."""
    host = sum(v for k, v in parts.items() if k.startswith("host"))
    return MemoryEstimate(device_bytes=sum(parts.values()) - host, host_bytes=host)


@dataclass
class StepStats:
    """Counters of one decode step. Systems add to them; the runner averages them over the run."""

    lookups: int = 0  # cache decisions taken, in the system's unit (KVOffloadSystem.hit_unit)
    hits: int = 0
    refreshes: int = 0  # units fetched every step by design, with no decision (CLO's prefetch heads)
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    host_syncs: int = 0
    # the system's own CPU work on the step's path (RetroInfer's LRU, timed on the host; InfiniGen's gather, its
    # bytes at the gather's bandwidth measured alone): the third part of the system's own floor, beside its device
    # bytes and its link bytes
    host_work_ms: float = 0.0
    phase_ms: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


@contextlib.contextmanager
def host_work(step: StepStats):
    """Times the block as the step's host work (StepStats.host_work_ms)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        step.host_work_ms += (time.perf_counter() - t0) * 1e3


class KVOffloadSystem(ABC):
    name: str = "abstract"
    hit_unit: str | None = None  # what one lookup is (a system with a cache says; the record states it)
    wants_speculative_query: bool = False
    # True when decode() can be captured in a CUDA graph once static_shapes is set: it then takes the
    # token position from `self.position` (a device tensor, updated before each replay) instead of `self.length`.
    supports_cuda_graph: bool = False
    # the host-store formats it offers (KVSpec.kv_dtype): fp8 for a system that keeps rows in host memory
    kv_dtypes: tuple[str, ...] = ("model",)

    def __init__(self) -> None:
        self.spec: KVSpec | None = None
        self.timer: PhaseTimer | None = None
        self.step = StepStats()
        self.length = 0  # tokens held per sequence
        self.static_shapes = False
        self.position = torch.zeros(1, dtype=torch.long)
        self.selections: dict[int, torch.Tensor] | None = None  # keep_selections() turns them on

    # ---- lifecycle -------------------------------------------------------------------------------------
    @abstractmethod
    def estimate_parts(self, spec: KVSpec) -> dict[str, int]:
        """Bytes by named part (as memory_parts() will report them) that allocate(spec) and a prefill of
        spec.prompt_tokens will hold, from the shapes alone; must not allocate. The parts named host* ("host",
        "host_metadata", ...) are host memory, every other part device memory."""

    @abstractmethod
    def memory_parts(self) -> dict[str, int]:
        """The same parts from the real buffers, after prefill."""

    def estimate_memory(self, spec: KVSpec) -> MemoryEstimate:
        """What allocate(spec) would take: the runner refuses a run that does not fit before it starts."""
        return split_host(self.estimate_parts(spec))

    def pinned_host_bytes(self, spec: KVSpec) -> int:
        """What the host part takes of the host's RAM once pinned (on CUDA): torch's pinned allocator rounds each
        allocation up to a power of two, so a system whose host stores it pins counts them so. By default the
        host part as estimated."""
        return self.estimate_memory(spec).host_bytes

    def allocate(self, spec: KVSpec, timer: PhaseTimer | None = None) -> None:
        est = self.estimate_memory(spec)
        if spec.gpu_budget_bytes is not None and est.device_bytes > spec.gpu_budget_bytes:
            raise ConfigError(
                f"{self.name} needs {est.device_bytes / GB:.2f} GB of device memory for its KV state but the "
                f"budget is {spec.gpu_budget_bytes / GB:.2f} GB; lower seqlen/batch or raise hardware.gpu_mem_gb"
            )
        check_kv_dtype(spec.kv_dtype, self.name, self.kv_dtypes)
        self.spec = spec
        self.timer = timer or PhaseTimer(spec.device)
        self.length = 0
        self.position = torch.zeros(1, dtype=torch.long, device=spec.device)
        self._allocate(spec)

    def use_static_shapes(self) -> None:
        """Switch decode() to its graph-capturable form (fixed shapes, position read from the device)."""
        if not self.supports_cuda_graph:
            raise ConfigError(f"system {self.name} cannot be captured in a CUDA graph; use decode_mode=eager")
        self.static_shapes = True

    @abstractmethod
    def _allocate(self, spec: KVSpec) -> None:
        """Allocate what estimate_parts(spec) promised (allocate() has checked it against the budget and set spec,
        timer, length and position); nothing here may depend on the prompt's values."""

    # ---- per layer ---------------------------------------------------------------------------------------
    @abstractmethod
    def prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The prompt's post-RoPE K and V of `layer`, [B, Hkv, T, D], once per layer in order, after the layer's
        dense prefill attention (a system never changes the prefill's output). The caller does not reuse them: the
        system may keep, copy, offload or index them. end_prefill(T) follows the last layer."""

    def prepare(self, layer: int, q_spec: torch.Tensor) -> None:  # noqa: B027 (optional: a no-op by default)
        """One layer ahead: a speculative query for `layer`, given while the layer before it computes."""

    @abstractmethod
    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One decode step of `layer`: q [B, H, D] the step's post-RoPE query, k and v [B, Hkv, D] the new token's,
        which the system appends at position `self.length` (or reads `self.position` on the device under static
        shapes); returns the attention output [B, H, D] over every token it decides to attend. Called between
        begin_step() and end_step(), layers in order; the statistics of the step go into `self.step`."""

    # ---- per step ----------------------------------------------------------------------------------------
    def end_prefill(self, prompt_len: int) -> None:
        self.length = prompt_len

    def begin_step(self) -> None:
        self.step = StepStats()
        assert self.timer is not None
        self.timer.begin_step()
        self.position.fill_(self.length)  # outside any captured graph: the graph reads it

    def end_step(self) -> StepStats:
        assert self.timer is not None
        self.length += 1
        self.step.phase_ms = self.timer.end_step()
        return self.step

    def phase(self, name: str):
        assert self.timer is not None
        return self.timer.phase(name)

    def memory_held(self) -> MemoryEstimate:
        """Bytes the system holds now (from its real buffers, not from the estimate)."""
        return split_host(self.memory_parts())

    def step_device_bytes(self) -> int | None:
        """Device-memory bytes one steady decode step of this system reads (its KV-side memory floor), asked once
        after the run: with the step's link bytes (StepStats.bytes_h2d) and its host work it makes the record's
        floor of the system. None: the record has no such floor, only the dense one (every held K/V byte)."""
        return None

    def describe(self) -> dict:
        """What the record should say about this system's state and sources (plans, scores, weights)."""
        return {}

    # ---- what a step attended (measurement only) ------------------------------------------------------------
    def keep_selections(self) -> None:
        """From now on keep, per sparse layer, which prompt positions its last decode attended
        (attended_positions): off by default, so that no speed run pays for it."""
        self.selections = {}

    def note_selection(self, layer: int, positions: torch.Tensor) -> None:
        """A system's decode (or its one-layer-ahead selection) hands over the prompt positions it attends in
        `layer`; kept only after keep_selections()."""
        if self.selections is not None:
            self.selections[layer] = positions

    def always_attended(self, prompt_len: int) -> tuple[int, int] | None:
        """(sink, recent): how many of the first and last positions of a prompt_len-token prompt every step of a
        sparse layer attends whole, for the selection probe's middle; None: the probe reads the system's `sink` and
        `recent` settings (a system without them attends everything)."""
        return None

    def attended_positions(self, layer: int) -> torch.Tensor | None:
        """The prompt positions [B, Hkv, n] that the last decode of `layer` attended (its sink, recent and selected
        tokens; every generated token is attended besides), in the model's head order, -1 where a row is no token;
        None where the system attends the whole prompt (a dense layer, FullAttn) or does not say."""
        return None if self.selections is None else self.selections.get(layer)
