"""RetroInfer's CPU-side block cache manager (docs/systems.md, "RetroInfer-style"): an exact LRU of `capacity` device
cache slots per KV head, updated once per decode step for the whole set of blocks the step retrieved.

RetroInfer does this in C++ with a thread pool (WaveBufferCPU / BufferManager in microsoft/RetrievalAttention:
an ordered set per head, misses admitted in retrieval order until the cache is full, the rest bypass it). A
baseline's CPU side must run at native speed, since that cost is what the comparison is about, so there are two
backends that decide exactly alike:
  native  (default) compiled with numba, one head per thread, O(1) work per looked-up block (baselines/lru_native.py)
  torch   the same decisions vectorised over every head of a layer with torch on the CPU - a handful of
          gather/scatter/cumsum/topk calls per step, no Python loop over blocks or heads; with threads > 1 the heads
          are split into chunks processed concurrently. The readable specification, and the test's reference.

Per head the state is three arrays:
  block_slot [n_blocks]  slot holding the block, -1 if not cached
  slot_block [capacity]  block held by the slot, -1 if empty
  slot_stamp [capacity]  (torch) time of last use; unique, so the least recently used slot is exact. The empty slots
                         start at -capacity + slot, before any use: slot 0 is the least recently used, so ties
                         never arise and both backends fill the empty slots in ascending order
  slot_link  [capacity]  (native, instead of the stamps, same bytes) (prev, next) of a doubly linked list over the
                         slots from least to most recently used, starting 0, 1, ..., capacity - 1
Each array has one extra "trash" column that masked scatters write into (the native list's sentinel), so no op
needs a boolean compaction.

A step, per head: the step's distinct blocks (deduplicated on the device before they are copied here) are
looked up; hits are touched first (made most recent in ascending block order), then misses are admitted in
ascending block order into the least recently used slots not hit in this step, in LRU order, as long as such slots
remain (misses beyond that are fetched but bypass the cache, as RetroInfer's).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numba
import torch

from baselines import lru_native
from kvoffload.errors import ConfigError


@dataclass
class LRUStep:
    """What one step decided, for the system to move data. Per-block arrays follow the input [rows, u]."""

    slot: torch.Tensor  # [rows, u] int64: cache slot of the block if it was a hit, else -1
    miss: torch.Tensor  # [rows, u] int64: index of the block in the miss list if it missed, else -1
    miss_row: torch.Tensor  # [M] int64: head (row) of each missed block
    miss_block: torch.Tensor  # [M] int64: block id of each missed block
    admit_pos: torch.Tensor  # [A] int64: which misses enter the cache (index into the miss list)
    admit_slot: torch.Tensor  # [A] int64: and the slot each one takes
    lookups: int  # (head, block) pairs looked up
    hits: int
    evictions: int  # admitted misses that displaced a cached block


PARALLEL_MIN = 1 << 15  # torch: below this many looked-up entries one thread is faster than handing out chunks
# native: below this many lookups a step runs on the calling thread. Its work is a few microseconds there, less than
# waking a parallel region's threads, and where other processes share the cores (a CPU accuracy sweep) a region's
# barrier can wait a scheduler slice for a thread that is not running. Figure 10's smallest step is above it.
NATIVE_PARALLEL_MIN = 512
# above it, a thread per this many lookups at most: a thread with less work costs more to wake than it saves. On the
# GPU machine's 16 cores this gave Figure 10's 8K BSZ 1 step (8 rows x 92 blocks) 4 threads, which ran it faster
# than 8 in each of two paired sweeps; from 128K (a head's 1628 blocks) every row keeps its own thread
# (results/investigations/retroinfer_host_path/).
NATIVE_LOOKUPS_PER_THREAD = 184
BACKENDS = ("native", "torch")


class BlockLRU:
    def __init__(
        self, rows: int, n_blocks: int, capacity: int, threads: int = 1, backend: str = "native", deferred: bool = False
    ):
        if threads < 1:
            raise ConfigError(f"BlockLRU threads={threads} must be at least 1")
        if backend not in BACKENDS:
            raise ConfigError(f"BlockLRU backend={backend!r} is not one of {BACKENDS}")
        self.rows, self.n_blocks, self.capacity, self.backend = rows, n_blocks, capacity, backend
        self.block_slot = torch.full((rows, n_blocks + 1), -1, dtype=torch.int64)
        self.slot_block = torch.full((rows, capacity + 1), -1, dtype=torch.int64)
        if backend == "native":
            self.slot_link = lru_native.new_links(rows, capacity)
            # numba's thread count is per calling thread and capped by the pool it started with
            # and more threads than heads only add a parallel region's start-up cost
            self.threads = min(threads, rows, numba.config.NUMBA_NUM_THREADS)
            self.step_threads = 0  # the last step's: its lookups decide how many of them run (_set_threads)
            self.arrays = (self.block_slot.numpy(), self.slot_block.numpy(), self.slot_link.numpy())  # shared memory
            lru_native.warm(deferred)  # compile here, once per process, not in the first timed step
            return
        self.slot_stamp = torch.full((rows, capacity + 1), -1, dtype=torch.int64)
        self.slot_stamp[:, :capacity] = torch.arange(capacity) - capacity  # distinct: slot 0 least recently used
        self.clock = 0
        bounds = torch.linspace(0, rows, min(threads, rows) + 1).round().long().tolist()
        self.chunks = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        self.pool = ThreadPoolExecutor(len(self.chunks)) if len(self.chunks) > 1 else None

    @property
    def nbytes(self) -> int:
        order = self.slot_link if self.backend == "native" else self.slot_stamp
        return self.block_slot.nbytes + self.slot_block.nbytes + order.nbytes

    def order(self) -> torch.Tensor:
        """[rows, capacity] slots from least to most recently used (for tests and inspection)."""
        if self.backend == "native":
            return lru_native.order(self.slot_link)
        return self.slot_stamp[:, : self.capacity].argsort(1)

    def access(self, blocks: torch.Tensor) -> LRUStep:
        """blocks [rows, n] integer CPU tensor: each row's distinct block ids, ascending, then padding = n_blocks."""
        if self.backend == "native":
            return self._access_native(blocks)
        blocks = blocks.long()
        u = int((blocks != self.n_blocks).sum(1).max()) if blocks.numel() else 0
        blocks = blocks[:, :u]  # the padding tail is dropped: the work is proportional to the distinct blocks
        clock = self.clock
        self.clock += u + 1  # stamps of one step lie in [clock, clock + u): unique over time
        if self.pool is None or blocks.numel() < PARALLEL_MIN:
            parts = [self._access(blocks, 0, self.rows, clock)]
        else:
            parts = list(self.pool.map(lambda c: self._access(blocks[c[0] : c[1]], c[0], c[1], clock), self.chunks))
        if len(parts) == 1:
            return parts[0]
        offsets, total = [], 0
        for p in parts:  # miss indices of later chunks shift by the misses before them
            offsets.append(total)
            total += p.miss_row.numel()
        cat = torch.cat
        return LRUStep(
            slot=cat([p.slot for p in parts]),
            miss=cat([torch.where(p.miss >= 0, p.miss + o, -1) for p, o in zip(parts, offsets)]),
            miss_row=cat([p.miss_row for p in parts]),
            miss_block=cat([p.miss_block for p in parts]),
            admit_pos=cat([p.admit_pos + o for p, o in zip(parts, offsets)]),
            admit_slot=cat([p.admit_slot for p in parts]),
            lookups=sum(p.lookups for p in parts),
            hits=sum(p.hits for p in parts),
            evictions=sum(p.evictions for p in parts),
        )

    def _set_threads(self, blocks) -> None:
        """numba's thread count for this step: per calling thread, so set at every call."""
        n = blocks.size
        self.step_threads = max(1, min(self.threads, n // NATIVE_LOOKUPS_PER_THREAD)) if n >= NATIVE_PARALLEL_MIN else 1
        numba.set_num_threads(self.step_threads)

    def access_into(self, blocks, dest, src, counts) -> None:
        """The graph path's step (lru_native.access_into): numpy views of pinned buffers, written in place."""
        assert self.backend == "native", "access_into is the native backend's"
        self._set_threads(blocks)
        lru_native.access_into(blocks, self.n_blocks, *self.arrays, dest, src, counts)

    def decide_into(self, blocks, dest, src, counts) -> None:
        """access_into's outputs, the state as it was until update(blocks) (lru_native.decide_into)."""
        assert self.backend == "native", "decide_into is the native backend's"
        self._set_threads(blocks)
        lru_native.decide_into(blocks, self.n_blocks, *self.arrays, dest, src, counts)

    def update(self, blocks) -> None:
        """The state change of the step decide_into decided for the same blocks (one thread, GIL released)."""
        lru_native.update(blocks, self.n_blocks, *self.arrays)

    def _access_native(self, blocks: torch.Tensor) -> LRUStep:
        b = blocks.to(torch.int32).contiguous().numpy()  # one dtype and layout: one compiled kernel
        self._set_threads(b)
        *arrays, lookups, hits, evictions = lru_native.access(b, self.n_blocks, *self.arrays)
        return LRUStep(*map(torch.from_numpy, arrays), lookups=int(lookups), hits=int(hits), evictions=int(evictions))

    def _access(self, ublock: torch.Tensor, r0: int, r1: int, clock: int) -> LRUStep:
        block_slot, slot_block, slot_stamp = self.block_slot[r0:r1], self.slot_block[r0:r1], self.slot_stamp[r0:r1]
        nb, cap = self.n_blocks, self.capacity
        valid = ublock != nb
        uslot = block_slot.gather(1, ublock)  # the trash column reads -1: padding never hits
        hit = uslot >= 0
        miss = valid & ~hit
        # touch the hits
        n_hit = hit.sum(1, keepdim=True)
        slot_stamp.scatter_(1, torch.where(hit, uslot, cap), clock + hit.cumsum(1) - 1)
        # admit misses into the least recently used slots that this step did not hit
        mrank = miss.cumsum(1) - 1
        n_admit = torch.minimum(miss.sum(1, keepdim=True), cap - n_hit)
        admitted = miss & (mrank < n_admit)
        m = int(n_admit.max()) if ublock.numel() else 0
        evictions = 0
        vslot = torch.full_like(ublock, cap)
        if m:
            victims = slot_stamp[:, :cap].topk(m, dim=1, largest=False, sorted=True).indices
            vslot = torch.where(admitted, victims.gather(1, mrank.clamp(0, m - 1)), cap)
            old = slot_block.gather(1, vslot)
            evicted = admitted & (old >= 0)
            evictions = int(evicted.sum())
            block_slot.scatter_(1, torch.where(evicted, old, nb), -1)
            block_slot.scatter_(1, torch.where(admitted, ublock, nb), vslot)
            slot_block.scatter_(1, vslot, ublock)
            slot_stamp.scatter_(1, vslot, clock + n_hit + mrank)
            block_slot[:, nb] = -1  # masked writes landed in the trash columns: reset them
            slot_block[:, cap] = -1
        # the miss list, row-major: one compaction, the rest indexes the (short) list
        rows, cols = miss.nonzero(as_tuple=True)
        miss_idx = torch.full_like(ublock, -1)
        miss_idx[rows, cols] = torch.arange(rows.numel())
        admit_pos = admitted[rows, cols].nonzero().view(-1)
        return LRUStep(
            slot=torch.where(hit, uslot, -1),
            miss=miss_idx,
            miss_row=rows + r0,
            miss_block=ublock[rows, cols],
            admit_pos=admit_pos,
            admit_slot=vslot[rows[admit_pos], cols[admit_pos]],
            lookups=int(valid.sum()),
            hits=int(hit.sum()),
            evictions=evictions,
        )


def distinct_sorted(blocks: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [R, n] ascending per row -> (distinct blocks compacted left, `pad` after them; for every entry the
    index of its distinct block). On the device: only the distinct ids need to reach the CPU."""
    first = torch.ones_like(blocks, dtype=torch.bool)
    first[:, 1:] = blocks[:, 1:] != blocks[:, :-1]
    uid = first.cumsum(1) - 1
    return torch.full_like(blocks, pad).scatter_(1, uid, blocks), uid
