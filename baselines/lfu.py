"""PQCache's CPU-side block cache manager: an LFU of `capacity` device slots per sequence, updated once a step with
the blocks the step admits (PQCache: vq_method/retrieval_based/lfu, C++, one cache per layer).

Its rule, from that code: inserting a cached block counts one more use of it; inserting a block that is not cached
takes a free slot, or evicts the least frequently used block, the least recently counted among equals (PQCache
keeps a list per use count, newest first, and evicts the oldest of the lowest count), and starts at one use. A
block inserted earlier in the same batch can be evicted by a later one, as there.

Per sequence the state is
  block_slot [n_blocks]  slot holding the block, -1 if not cached
  slot_block [capacity]  block the slot holds
  slot_uses  [capacity]  its use count
  slot_stamp [capacity]  when it was last counted (a per-sequence clock: unique, so eviction has no ties)
`insert` is compiled with numba (a baseline's CPU side runs at native speed); `LFUReference` is the readable
specification, PQCache's count lists, which the tests compare it with."""

from __future__ import annotations

import numba
import numpy as np
import torch


@numba.njit(cache=False)
def _insert(blocks, block_slot, slot_block, slot_uses, slot_stamp, clock, used, before, after):  # pragma: no cover
    """blocks [B, A] (-1: none) into each sequence's cache; before/after [B, A]: each block's slot before the batch
    and after it (-1: not cached). Returns evictions."""
    evictions = 0
    cap = slot_block.shape[1]
    for b in range(blocks.shape[0]):
        for i in range(blocks.shape[1]):
            blk = blocks[b, i]
            before[b, i] = -1 if blk < 0 else block_slot[b, blk]
    for b in range(blocks.shape[0]):
        for i in range(blocks.shape[1]):
            blk = blocks[b, i]
            if blk < 0:
                continue
            clock[b] += 1
            s = block_slot[b, blk]
            if s >= 0:
                slot_uses[b, s] += 1
                slot_stamp[b, s] = clock[b]
                continue
            if used[b] < cap:
                s = used[b]
                used[b] += 1
            else:
                s = 0
                for j in range(1, cap):
                    if slot_uses[b, j] < slot_uses[b, s] or (
                        slot_uses[b, j] == slot_uses[b, s] and slot_stamp[b, j] < slot_stamp[b, s]
                    ):
                        s = j
                block_slot[b, slot_block[b, s]] = -1
                evictions += 1
            slot_block[b, s] = blk
            block_slot[b, blk] = s
            slot_uses[b, s] = 1
            slot_stamp[b, s] = clock[b]
    for b in range(blocks.shape[0]):
        for i in range(blocks.shape[1]):
            blk = blocks[b, i]
            after[b, i] = -1 if blk < 0 else block_slot[b, blk]
    return evictions


class BlockLFU:
    """Each of `batch` sequences' LFU over `n_blocks` blocks in `capacity` slots (host arrays)."""

    def __init__(self, batch: int, n_blocks: int, capacity: int):
        self.capacity = capacity
        self.block_slot = np.full((batch, n_blocks), -1, dtype=np.int64)
        self.slot_block = np.full((batch, capacity), -1, dtype=np.int64)
        self.slot_uses = np.zeros((batch, capacity), dtype=np.int64)
        self.slot_stamp = np.zeros((batch, capacity), dtype=np.int64)
        self.clock = np.zeros(batch, dtype=np.int64)
        self.used = np.zeros(batch, dtype=np.int64)

    def insert(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """blocks [B, A] int64 on the host (-1: none). Returns (slots [B, A]: where each inserted block now is, -1
        if a later insert of the batch evicted it; new [B, A] bool: it was not in that slot before, so its rows
        must be copied in; evictions)."""
        blk = blocks.numpy()
        before, after = np.empty_like(blk), np.empty_like(blk)
        evictions = _insert(
            blk, self.block_slot, self.slot_block, self.slot_uses, self.slot_stamp, self.clock, self.used, before, after
        )
        return torch.from_numpy(after), torch.from_numpy((after >= 0) & (after != before)), int(evictions)

    def nbytes(self) -> int:
        arrays = (self.block_slot, self.slot_block, self.slot_uses, self.slot_stamp, self.clock, self.used)
        return sum(a.nbytes for a in arrays)


class LFUReference:
    """One sequence's LFU as PQCache writes it: lists of blocks by use count, newest first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.uses: dict[int, int] = {}  # block -> use count
        self.lists: dict[int, list[int]] = {}  # use count -> its blocks, newest first

    def _move(self, blk: int, uses: int) -> None:
        self.lists.setdefault(uses, []).insert(0, blk)
        self.uses[blk] = uses

    def insert(self, blk: int) -> int | None:
        """Returns the block evicted, if any."""
        if blk in self.uses:
            n = self.uses[blk]
            self.lists[n].remove(blk)
            self._move(blk, n + 1)
            return None
        evicted = None
        if len(self.uses) == self.capacity:
            lowest = min(n for n, blocks in self.lists.items() if blocks)
            evicted = self.lists[lowest].pop()
            del self.uses[evicted]
        self._move(blk, 1)
        return evicted
