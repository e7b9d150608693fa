"""RetroInfer's CPU-side block cache manager (spec 3): an exact LRU of `capacity` device cache slots per KV head,
updated once per decode step for the whole set of blocks the step retrieved.

RetroInfer does this in C++ with a thread pool (WaveBufferCPU / BufferManager in microsoft/RetrievalAttention:
an ordered set per head, misses admitted in retrieval order until the cache is full, the rest bypass it). Here
the same decisions are vectorised over every head of a layer at once with torch on the CPU - a handful of
gather/scatter/cumsum/topk calls per step, no Python loop over blocks or heads - and, with threads > 1, the
heads are split into chunks processed concurrently (torch releases the GIL inside each op).

Per head the state is three arrays:
  block_slot [n_blocks]  slot holding the block, -1 if not cached
  slot_block [capacity]  block held by the slot, -1 if empty
  slot_stamp [capacity]  time of last use (-1 if empty); unique, so the least recently used slot is exact
Each array has one extra "trash" column that masked scatters write into, so no op needs a boolean compaction.

A step, per head: the step's distinct blocks (deduplicated on the device before they are copied here) are
looked up; hits are touched first (stamped in ascending block order), then misses are admitted in ascending
block order into the least recently used slots not hit in this step, as long as such slots remain (misses
beyond that are fetched but bypass the cache, as RetroInfer's).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch


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


PARALLEL_MIN = 1 << 15  # below this many looked-up entries one thread is faster than handing out chunks


class BlockLRU:
    def __init__(self, rows: int, n_blocks: int, capacity: int, threads: int = 1):
        self.rows, self.n_blocks, self.capacity = rows, n_blocks, capacity
        self.block_slot = torch.full((rows, n_blocks + 1), -1, dtype=torch.int64)
        self.slot_block = torch.full((rows, capacity + 1), -1, dtype=torch.int64)
        self.slot_stamp = torch.full((rows, capacity + 1), -1, dtype=torch.int64)
        self.clock = 0
        bounds = torch.linspace(0, rows, min(threads, rows) + 1).round().long().tolist()
        self.chunks = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        self.pool = ThreadPoolExecutor(len(self.chunks)) if len(self.chunks) > 1 else None

    @property
    def nbytes(self) -> int:
        return self.block_slot.nbytes + self.slot_block.nbytes + self.slot_stamp.nbytes

    def access(self, blocks: torch.Tensor) -> LRUStep:
        """blocks [rows, n] integer CPU tensor: each row's distinct block ids, ascending, then padding = n_blocks."""
        blocks = blocks.long()
        u = int((blocks != self.n_blocks).sum(1).max()) if blocks.numel() else 0
        blocks = blocks[:, :u]  # the padding tail is dropped: the work is proportional to the distinct blocks
        clock = self.clock
        self.clock += u + 1  # stamps of one step lie in [clock, clock + u): unique over time
        if self.pool is None or blocks.numel() < PARALLEL_MIN:
            parts = [self._access(blocks, 0, self.rows, clock)]
        else:
            parts = list(self.pool.map(lambda c: self._access(blocks[c[0]:c[1]], c[0], c[1], clock), self.chunks))
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
            miss_row=cat([p.miss_row for p in parts]), miss_block=cat([p.miss_block for p in parts]),
            admit_pos=cat([p.admit_pos + o for p, o in zip(parts, offsets)]),
            admit_slot=cat([p.admit_slot for p in parts]),
            lookups=sum(p.lookups for p in parts), hits=sum(p.hits for p in parts),
            evictions=sum(p.evictions for p in parts))

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
            slot=torch.where(hit, uslot, -1), miss=miss_idx, miss_row=rows + r0, miss_block=ublock[rows, cols],
            admit_pos=admit_pos, admit_slot=vslot[rows[admit_pos], cols[admit_pos]],
            lookups=int(valid.sum()), hits=int(hit.sum()), evictions=evictions)


def distinct_sorted(blocks: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [R, n] ascending per row -> (distinct blocks compacted left, `pad` after them; for every entry the
    index of its distinct block). On the device: only the distinct ids need to reach the CPU."""
    first = torch.ones_like(blocks, dtype=torch.bool)
    first[:, 1:] = blocks[:, 1:] != blocks[:, :-1]
    uid = first.cumsum(1) - 1
    return torch.full_like(blocks, pad).scatter_(1, uid, blocks), uid
