"""BlockLRU's native backend (baselines/lru.py): the same decisions as its torch code, compiled with numba, one head
(row) per thread, O(1) work per looked-up block - what RetroInfer's C++ thread pool costs, not a Python emulation.

Per row the recency order is a circular doubly linked list over the slots: link[r, s] = (prev, next), with node
`capacity` (the state's trash column) as the sentinel, so link[r, cap, NEXT] is the least recently used slot and
link[r, cap, PREV] the most recently used. It takes the place of the torch backend's stamps, in as many bytes.
A step moves each hit to the tail in ascending block order; the non-hit slots are then the head of the list, in
LRU order, so the admitted misses take the first of them in turn, and that segment moves to the tail at once, its
order kept - no search, no sort.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import prange

PREV, NEXT = 0, 1
U = np.uint64  # indexing with unsigned ints spares numba's negative-index wraparound check, a cost in the hot loops


def new_links(rows: int, capacity: int) -> torch.Tensor:
    """[rows, capacity + 1, 2] int32: the list sentinel -> 0 -> 1 -> ... -> capacity - 1 -> sentinel, so slot 0 is
    the least recently used (as the torch backend's initial stamps say)."""
    node = torch.arange(capacity + 1, dtype=torch.int32)
    one = torch.stack([(node - 1) % (capacity + 1), (node + 1) % (capacity + 1)], 1)
    return one.expand(rows, -1, -1).contiguous()


@numba.njit(inline="always")
def _to_tail(lk, s, sentinel):  # unlink slot s and make it the most recently used
    s = U(s)
    p, n = U(lk[s, PREV]), U(lk[s, NEXT])
    lk[p, NEXT] = n
    lk[n, PREV] = p
    t = U(lk[sentinel, PREV])
    lk[t, NEXT] = s
    lk[s, PREV] = t
    lk[s, NEXT] = sentinel
    lk[sentinel, PREV] = s


@numba.njit(inline="always")
def _row_step(lk, bsl, sbl, blocks_r, u, nb, slot_r, mcol_r, mslot_r):
    """One head's step: look its u blocks up, touch the hits, admit the misses. slot_r[j] := the block's slot if
    it hit, else -1; mcol_r[:m] the columns of the misses in order; mslot_r[:a] the slots the first a misses
    took. Returns (hits, misses, admitted, evictions)."""
    cap = sbl.shape[0] - 1
    h = m = 0
    for j in range(u):  # branch-free: hits and misses interleave at random, a branch would mispredict
        b = blocks_r[j]
        s = bsl[U(b)]  # padding reads the trash column's -1: never a hit, and not counted as a miss
        slot_r[j] = s
        mslot_r[h], mcol_r[m] = s, j  # written always, kept only by the count advancing
        h += s >= 0
        m += (s < 0) & (b != nb)
    for k in range(h):  # touch the hits in ascending block order
        _to_tail(lk, mslot_r[k], cap)
    # admit: the list now starts with the cap - h slots not hit in this step, least recent first; the first
    # a of them are the victims, in order
    a, e = min(m, cap - h), 0
    v = lk[cap, NEXT]
    for k in range(a):
        mslot_r[k] = v
        v = lk[U(v), NEXT]
    for k in range(a):  # iterations independent of each other: their cache misses overlap
        v = mslot_r[k]
        old = sbl[U(v)]
        if old >= 0:
            bsl[U(old)] = -1
            e += 1
        b = blocks_r[mcol_r[k]]
        bsl[U(b)] = v
        sbl[U(v)] = b
    if a:  # the victims keep their order: move the whole segment from the head to the tail
        first, last = lk[cap, NEXT], mslot_r[a - 1]
        after, tail = lk[last, NEXT], lk[cap, PREV]
        if after != cap:
            lk[cap, NEXT], lk[after, PREV] = after, cap
            lk[tail, NEXT], lk[first, PREV] = first, tail
            lk[last, NEXT], lk[cap, PREV] = cap, last
    return h, m, a, e


@numba.njit(nogil=True, parallel=True, cache=True)
def access(blocks, nb, block_slot, slot_block, link):
    """blocks [rows, n] int32 C-contiguous (distinct ascending ids, then padding nb); the state arrays are updated
    in place. Returns LRUStep's arrays and counts (see baselines/lru.py)."""
    rows, n = blocks.shape
    valid = np.zeros(rows, np.int64)
    for r in prange(rows):
        c = 0
        for j in range(n):
            c += blocks[r, j] != nb
        valid[r] = c
    u = 0  # the padding tail is dropped, as in the torch code
    for r in range(rows):
        u = max(u, valid[r])
    slot = np.empty((rows, u), np.int64)
    miss = np.full((rows, u), -1, np.int64)
    mcol = np.empty((rows, u), np.int32)  # per row: the column of each miss, in order
    mslot = np.empty((rows, u), np.int32)  # the slots hit, then the slots the admitted misses took
    n_hit, n_miss = np.zeros(rows, np.int64), np.zeros(rows, np.int64)
    n_admit, n_evict = np.zeros(rows, np.int64), np.zeros(rows, np.int64)
    for r in prange(rows):
        h, m, a, e = _row_step(link[r], block_slot[r], slot_block[r], blocks[r], u, nb, slot[r], mcol[r], mslot[r])
        n_hit[r], n_miss[r], n_admit[r], n_evict[r] = h, m, a, e
    # the miss list is row-major: offsets by a (short, serial) prefix sum over rows, then filled per row
    moff, aoff = np.zeros(rows + 1, np.int64), np.zeros(rows + 1, np.int64)
    for r in range(rows):
        moff[r + 1] = moff[r] + n_miss[r]
        aoff[r + 1] = aoff[r] + n_admit[r]
    miss_row, miss_block = np.empty(moff[rows], np.int64), np.empty(moff[rows], np.int64)
    admit_pos, admit_slot = np.empty(aoff[rows], np.int64), np.empty(aoff[rows], np.int64)
    for r in prange(rows):
        for k in range(n_miss[r]):
            j, p = mcol[r, k], moff[r] + k
            miss[r, j] = p
            miss_row[p] = r
            miss_block[p] = blocks[r, j]
        for k in range(n_admit[r]):  # the admitted misses are each row's first ones
            admit_pos[aoff[r] + k] = moff[r] + k
            admit_slot[aoff[r] + k] = mslot[r, k]
    return (slot, miss, miss_row, miss_block, admit_pos, admit_slot, valid.sum(), n_hit.sum(), n_evict.sum())


@numba.njit(nogil=True, parallel=True, cache=True)
def access_into(blocks, nb, block_slot, slot_block, link, dest, src, counts):
    """The same step for the graph path, every output in a buffer of fixed shape (pinned, copied to the device
    as it is): blocks [rows, n] int32 (ascending, no padding: block selection retrieves n distinct blocks per
    head and the cache holds at least n, so every miss is admitted); dest [rows, n] int32 := the cache slot of
    each block (hit or just admitted); src [rows, n] int32 := r * nb + block for a miss (its block in the flat
    host store), -1 for a hit; counts [3] int64 := (lookups, hits, evictions)."""
    rows, n = blocks.shape
    hits, evictions = np.zeros(rows, np.int64), np.zeros(rows, np.int64)
    for r in prange(rows):
        slot_r = np.empty(n, np.int64)
        mcol = np.empty(n, np.int32)
        mslot = np.empty(n, np.int32)
        h, m, a, e = _row_step(link[r], block_slot[r], slot_block[r], blocks[r], n, nb, slot_r, mcol, mslot)
        for j in range(n):
            dest[r, j] = slot_r[j]
            src[r, j] = -1
        for k in range(a):  # a == m here (see above)
            j = mcol[k]
            dest[r, j] = mslot[k]
            src[r, j] = r * nb + blocks[r, j]
        hits[r], evictions[r] = h, e
    counts[0], counts[1], counts[2] = rows * n, hits.sum(), evictions.sum()


@numba.njit(nogil=True, cache=True)
def _row_decide(lk, bsl, sbl, blocks_r, base, dest_r, src_r):
    """decide_into's work for one row; returns (hits, evictions). Not inlined into the prange loop: numba's
    parfor reduction analysis (some versions) fails on the victim walk's loop-carried `v` there."""
    cap = lk.shape[0] - 1
    n = blocks_r.shape[0]
    h = 0
    for j in range(n):
        s = bsl[U(blocks_r[j])]
        dest_r[j], src_r[j] = s, -1
        if s >= 0:
            sbl[U(s)] = -2 - sbl[U(s)]
            h += 1
    v, e = lk[cap, NEXT], 0
    for j in range(n):
        if dest_r[j] < 0:
            while sbl[U(v)] < -1:
                v = lk[U(v), NEXT]
            dest_r[j], src_r[j] = v, base + blocks_r[j]
            e += sbl[U(v)] >= 0
            v = lk[U(v), NEXT]
    for j in range(n):
        if src_r[j] < 0:
            s = dest_r[j]
            sbl[U(s)] = -2 - sbl[U(s)]
    return h, e


@numba.njit(nogil=True, parallel=True, cache=True)
def decide_into(blocks, nb, block_slot, slot_block, link, dest, src, counts):
    """access_into's dest, src and counts, the state left as it was (the decision a step waits for; `update`
    then makes the state change, off the critical path, as RetroInfer's thread pool does). The victims are the
    slots not hit in this step, least recently used first: access_into's, which moves the hits to the tail
    before it takes them from the head. A hit slot is marked while the row is decided by flipping its
    slot_block entry b >= 0 to -2 - b (an unhit slot's entry is >= -1), and flipped back after."""
    rows, n = blocks.shape
    hits, evictions = np.zeros(rows, np.int64), np.zeros(rows, np.int64)
    for r in prange(rows):
        hits[r], evictions[r] = _row_decide(link[r], block_slot[r], slot_block[r], blocks[r], r * nb, dest[r], src[r])
    counts[0], counts[1], counts[2] = rows * n, hits.sum(), evictions.sum()


@numba.njit(nogil=True, cache=True)
def update(blocks, nb, block_slot, slot_block, link):
    """The state change of access_into for the same blocks, one thread (it runs beside the step's GPU work)."""
    rows, n = blocks.shape
    slot_r = np.empty(n, np.int64)
    mcol, mslot = np.empty(n, np.int32), np.empty(n, np.int32)
    for r in range(rows):
        _row_step(link[r], block_slot[r], slot_block[r], blocks[r], n, nb, slot_r, mcol, mslot)


def warm(deferred: bool = False) -> None:
    """Compile (or load from numba's cache) and start the thread pool now, once per process: not in a timed step.
    deferred: decide_into and update too (only the deferred LRU update calls them)."""
    state = [torch.full((1, 2), -1, dtype=torch.int64).numpy() for _ in range(2)]
    access(np.zeros((1, 1), np.int32), 1, *state, new_links(1, 1).numpy())
    out = [np.zeros((1, 1), np.int32) for _ in range(2)]
    access_into(np.zeros((1, 1), np.int32), 1, *state, new_links(1, 1).numpy(), *out, np.zeros(3, np.int64))
    if deferred:
        decide_into(np.zeros((1, 1), np.int32), 1, *state, new_links(1, 1).numpy(), *out, np.zeros(3, np.int64))
        update(np.zeros((1, 1), np.int32), 1, *state, new_links(1, 1).numpy())


def order(link: torch.Tensor) -> torch.Tensor:
    """[rows, capacity] slots from least to most recently used (for tests and inspection: a Python walk)."""
    rows, cap = link.shape[0], link.shape[1] - 1
    out = torch.empty(rows, cap, dtype=torch.int64)
    for r in range(rows):
        s = int(link[r, cap, NEXT])
        for i in range(cap):
            out[r, i], s = s, int(link[r, s, NEXT])
    return out
