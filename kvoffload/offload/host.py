"""Host memory for a layer's offloaded KV and the prefill's copy into it, shared by every offloading system.

Pinned stores are allocated before the prefill where the prompt's length is known (pinning GBs keeps the host busy
long enough to leave the prefill's GPU waiting for its next launches), and each layer's copy runs on a stream of its
own while the decoder goes on to the next layer."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import torch

from kvoffload.errors import ConfigError
from kvoffload.kernels.fp8_rows import quantize_rows
from kvoffload.kv.interface import KVSpec
from kvoffload.offload.link import LinkPacer, paced_copy

_pin_threads = 0  # this process's setting: torch's default until pin_by_register changes it


def pin_by_register(threads: int) -> None:
    """How pinned host memory is made from here on (CUDA): threads 0, cudaHostAlloc (torch's default); N > 0 (a
    power of two), malloc'd pages first touched by N threads, then cudaHostRegister (torch's
    pinned_use_cuda_host_register). The first touch, zeroing tens of GB page by page, is most of pinning them: N
    threads share it. Under UVA the registered memory is mapped for the device as cudaHostAlloc's is
    (cudaHostRegisterDefault). Set only when it changes: torch's parser resets some other allocator settings (its
    max_split_size_mb among them) each time it parses."""
    global _pin_threads
    if threads == _pin_threads:
        return
    _pin_threads = threads
    settings = f"pinned_use_cuda_host_register:{threads > 0},pinned_num_register_threads:{max(threads, 1)}"
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch.cuda's own is deprecated
    (setter or torch.cuda.memory._set_allocator_settings)(settings)


# glibc >= 2.35: malloc madvises MADV_HUGEPAGE on the chunks it maps, so that the pages that pin_by_register's
# threads first touch are 2 MiB ones where the system's THP mode is "madvise". Read when a process starts.
THP_TUNABLE = "glibc.malloc.hugetlb=1"


def thp_env(env: dict[str, str], on: bool = True) -> dict[str, str]:
    """env for a process about to start, with glibc's huge-page tunable in its GLIBC_TUNABLES (on) or not (off);
    any other tunable kept."""
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t and not t.startswith("glibc.malloc.hugetlb")]
    tunables += [THP_TUNABLE] if on else []
    rest = {k: v for k, v in env.items() if k != "GLIBC_TUNABLES"}
    return rest | ({"GLIBC_TUNABLES": ":".join(tunables)} if tunables else {})


def huge_pages_enabled() -> bool:
    """Whether this process started with THP_TUNABLE."""
    return THP_TUNABLE in os.environ.get("GLIBC_TUNABLES", "").split(":")


def anon_huge_gib() -> float | None:
    """This process's anonymous memory on transparent huge pages (Linux's smaps_rollup; None elsewhere)."""
    try:
        lines = Path("/proc/self/smaps_rollup").read_text().splitlines()
    except OSError:
        return None
    kib = next((int(line.split()[1]) for line in lines if line.startswith("AnonHugePages:")), None)
    return None if kib is None else round(kib / 2**20, 3)


def empty_host_cache() -> None:
    """The pinned blocks torch's host allocator keeps cached after their tensors died go back to the OS."""
    empty = getattr(torch._C, "_accelerator_emptyHostCache", None) or getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def pinned_bytes(nbytes: int) -> int:
    """What torch's pinned host allocator takes for an nbytes request: its blocks are powers of two."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


# The largest block store_packs asks torch for: pinning one block of tens of GB can fail where smaller ones succeed
PACK_BYTES = 16 * 2**30


def store_packs(store: int, n: int) -> list[int]:
    """How many of n host stores of `store` bytes each pinned block holds. Torch's pinned allocator hands out
    powers of two, so a 3 GiB store alone pins 4 GiB (768K tokens of Llama-3-8B: 30 layers pin 120 GiB, more than
    a 128 GiB host has); several stores in one block leave less unused (30 x 3 GiB: six 16 GiB blocks of five,
    96 GiB). The packing pins the least (fewest blocks among equals) with no block above PACK_BYTES (or the one
    block a larger store needs). A power-of-two store has a block of its own: nothing to save, and the stores stay
    separate allocations."""
    if store & (store - 1) == 0:
        return [1] * n
    most = max(1, min(n, max(PACK_BYTES, pinned_bytes(store)) // store))  # stores one block may hold
    best: list[tuple[int, int, int]] = [(0, 0, 0)]  # best[k]: (bytes pinned, blocks, stores in the last) for k
    for k in range(1, n + 1):
        best.append(
            min((best[k - m][0] + pinned_bytes(m * store), best[k - m][1] + 1, m) for m in range(1, min(k, most) + 1))
        )
    packs = []
    while n:
        packs.append(best[n][2])
        n -= packs[-1]
    return packs


def store_shape(spec: KVSpec, rows: int) -> tuple[int, ...]:
    """A sparse layer's host store: [B, Hkv, rows, 2, D] (D: spec.host_width, packed bytes under kv_dtype=fp8)."""
    return (spec.batch, spec.num_kv_heads, rows, 2, spec.host_width)


def store_layout(spec: KVSpec, dense_layers: int, rows: int) -> tuple[tuple[int, ...], int, list[int]]:
    """(a store's shape, its bytes, store_packs of the sparse layers' stores): what host_stores allocates and
    host_stores_pinned counts, from one place."""
    shape = store_shape(spec, rows)
    store = math.prod(shape) * spec.host_dtype.itemsize
    return shape, store, store_packs(store, spec.num_layers - min(dense_layers, spec.num_layers))


def host_stores_pinned(spec: KVSpec, dense_layers: int, rows: int) -> tuple[int, int]:
    """(bytes, bytes pinned) of host_stores(spec, dense_layers, rows)'s buffers: one store per sparse layer, packed
    into pinned blocks by store_packs."""
    _, store, packs = store_layout(spec, dense_layers, rows)
    return sum(packs) * store, sum(pinned_bytes(m * store) for m in packs)


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype, pinned: bool, what: str = "a layer's") -> torch.Tensor:
    try:
        return torch.empty(shape, dtype=dtype, pin_memory=pinned)
    except RuntimeError as e:  # pinning tens of GB can fail well below the RAM size
        raise ConfigError(
            f"could not allocate {math.prod(shape) * dtype.itemsize / 2**30:.1f} GiB of pinned host memory for "
            f"{what} offloaded KV ({e}); lower seqlen or batch"
        ) from e


def host_stores(spec: KVSpec, dense_layers: int, rows: int | None) -> list[torch.Tensor | None]:
    """Every sparse layer's host store [B, Hkv, rows, 2, D], allocated (pinned on CUDA) before the prefill, as
    FullAttn allocates its device cache: pinning GBs keeps the host busy long enough to leave the prefill's GPU
    waiting for its next launches, and a failure to pin is reported before the long work. rows None (the
    prompt's length not known yet): None for every layer (the prefill allocates them)."""
    if rows is None:
        return [None] * spec.num_layers
    shape, _, packs = store_layout(spec, dense_layers, rows)
    stores: list[torch.Tensor | None] = [None] * (spec.num_layers - sum(packs))  # the dense layers'
    for m in packs:
        block = host_buffer(
            (m, *shape), spec.host_dtype, spec.device.type == "cuda", f"{m} layers'" if m > 1 else "a layer's"
        )
        stores += list(block.unbind(0))  # each layer's store a contiguous view of the block
    return stores


def layer_store(
    stores: list[torch.Tensor | None], layer: int, spec: KVSpec, dense_layers: int, rows: int
) -> torch.Tensor:
    """stores[layer], host_stores' list (filled in place), for a prefill that offloads `rows` rows a head. A list
    made before the prompt's length was known (every entry None) is filled at the first sparse layer's prefill,
    packed as host_stores packs it, so that what is pinned is what host_stores_pinned counts."""
    shape = store_shape(spec, rows)
    if stores[layer] is None:
        stores[:] = host_stores(spec, dense_layers, rows)
    if tuple(stores[layer].shape) != shape:  # the estimate and the pinning were for another prompt
        raise RuntimeError(
            f"layer {layer}'s host store holds {stores[layer].shape[2]} rows a head but its prefill offloads {rows}: "
            "the KVSpec's prompt_len must be the prompt's length"
        )
    return stores[layer]


# Rows [2, D] quantised at once on their way to a packed FP8 store: quantize_rows holds a few fp32 copies of what it
# quantises, which for a batch's whole layer at once would be tens of GB beside the prefill
QUANTIZE_ROWS = 1 << 15
QUANTIZE_BYTES_PER_ELEMENT = 16  # the input in fp32, its scaled and clamped copies, the e4m3 values and the output


def quantize_peak_bytes(head_dim: int) -> int:
    """The device memory copy_rows' quantisation holds at once (the preflight adds it under kv_dtype=fp8)."""
    return QUANTIZE_ROWS * 2 * head_dim * QUANTIZE_BYTES_PER_ELEMENT


def copy_rows(pacer: LinkPacer | None, host: torch.Tensor, kv: torch.Tensor) -> None:
    """host <- kv [B, Hkv, T, 2, D] (host contiguous, kv's rows contiguous within a sequence and head); where the
    host store is packed FP8 (uint8), quantised on the way, QUANTIZE_ROWS rows at a time: all the rows at once where
    kv is contiguous too, else each (sequence, head)'s in turn, so that every copy lands in a contiguous range."""
    if host.dtype != torch.uint8 or kv.dtype == torch.uint8:
        paced_copy(pacer, host, kv)
        return
    if kv.is_contiguous():
        host, kv = host.view(1, -1, *host.shape[-2:]), kv.view(1, -1, *kv.shape[-2:])
    h, k = host.flatten(0, -4), kv.flatten(0, -4)  # [blocks, rows, 2, D], views
    for i in range(h.shape[0]):
        for a in range(0, h.shape[1], QUANTIZE_ROWS):
            paced_copy(pacer, h[i, a : a + QUANTIZE_ROWS], quantize_rows(k[i, a : a + QUANTIZE_ROWS]))


class Offload:
    """On CUDA, a layer's host copy (into pinned memory: the copy engine, beside the compute stream's kernels) and
    its encoding run on a stream of their own, behind the layer's compute, while the decoder goes on to the next
    layer. The staged K/V they read is held until an event after them has completed: freed earlier, its memory
    would go to the next layer's kernels on the compute stream while the copy still reads it. Off CUDA both run
    in place. With a `pacer` (hardware.link_gb_s) the copy keeps to its cap on the device -> host clock."""

    def __init__(self, device: torch.device, pacer: LinkPacer | None = None):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pacer = pacer
        self.pending: tuple[torch.cuda.Event, torch.Tensor] | None = None  # (done, the staged K/V)

    def start(self, kv: torch.Tensor, host: torch.Tensor, encode: Callable[[], None] | None = None) -> None:
        """host <- kv, and encode() if given, after the work queued so far on the current stream. A packed FP8 host
        store (kv_dtype=fp8) takes kv quantised here, on the device and on this stream: the rows are quantised where
        they leave the device, once, and the link carries the packed bytes."""
        encode = encode or (lambda: None)
        if self.stream is None:
            copy_rows(None, host, kv)
            encode()
            return
        self.finish()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):  # each chunk's quantised rows freed on this stream, after their copy
            copy_rows(self.pacer, host, kv)
            encode()
            done = torch.cuda.Event()
            done.record()
        self.pending = (done, kv)

    def finish(self) -> None:
        """Waits on the host for the last offload to complete, then lets go of its staged K/V. A layer's prefill
        calls it first: by then the decoder has queued that layer's compute, which keeps the GPU busy meanwhile."""
        if self.pending is not None:
            self.pending[0].synchronize()
            self.pending = None
