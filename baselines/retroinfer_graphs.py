"""RetroInfer-style's decode step as its public code runs it on a GPU (microsoft/RetrievalAttention): the GPU work
between the CPU's sync points captured in per-layer CUDA graphs, every host<->device copy from pinned buffers,
the CPU's cache manager at native speed, attention in the same split kernel as CLO's.

Per sparse layer and step:
  retrieve (graph)  hash (or exact) scores, each block scored by its best token, the top blocks, sorted; the block
                    ids copied into this layer's pinned buffer
  sync              the host waits for that copy: the step's one host sync per layer (RetroInfer's too: its
                    cache_hub/retroinfer_cache.py copies the cluster ids to pinned memory without non_blocking,
                    then its thread pool looks them up; the LRU's update runs beside attention, our deferred mode)
  manage (CPU)      the LRU decides, for each selected block, its cache slot (a hit, or the slot a miss is admitted
                    into: block selection retrieves at most the cache's capacity, so every miss is admitted) and,
                    for a miss, its block in the host store; written into pinned buffers (lru_native.access_into).
                    With lru_update=deferred only the decision is made here (decide_into) and the LRU's state
                    change runs in a worker thread beside the fetch and attention (update), awaited before the
                    layer's next step
  fetch + attend    one graph: those buffers (and the window's length) copied to the device, the missed blocks
                    read from pinned host memory straight into their cache slots (uva_copy_blocks: zero-copy, no
                    staging), then attention over the window + the selected blocks' rows, read where they lie in
                    the cache (hybrid_attention with every head indexed; a partial last block's padding rows are
                    index -1: never attended); the slots' rows and flat addresses in one launch (block_rows)
A layer replays two graphs: nothing on the host separates the fetch from the attention, and each graph launch
after the sync is time the GPU waits (a trace of the step showed it idle for each launch).
"""

from __future__ import annotations

import torch

from baselines.offloaded import replay_graph
from kvoffload.kernels.block_rows import block_rows
from kvoffload.kernels.decode_attention import hybrid_attention
from kvoffload.kernels.uva_gather import uva_copy_blocks
from kvoffload.kv.interface import host_work
from kvoffload.offload.budget import split_prompt
from kvoffload.offload.link import moving
from kvoffload.offload.retrieval import select_topk, topk_work


class LayerGraphs:
    """One sparse layer's graphs and buffers. `system` is the RetroInfer instance (its retriever, cache, host
    store and LRU); made at the layer's first decode step, after the prompt is stored."""

    def __init__(self, system, layer: int, pool) -> None:
        spec = system.spec
        self.system, self.layer, self.pool = system, layer, pool
        self.bs = bs = system.block_size
        cache = system.cache[layer]
        self.rows, self.cap = cache.shape[:2]
        self.n_mid = split_prompt(system.t0, system.sink, system.recent)[2]
        self.nsel = system.k_select(system.t0) // bs
        assert self.cap >= self.nsel, "a step's blocks fit the cache (RetroInfer.geometry), so every miss is admitted"
        b, hkv, d, dev = spec.batch, spec.num_kv_heads, spec.head_dim, spec.device
        self.b, self.hkv, self.d = b, hkv, d
        self.q = torch.zeros(b, spec.num_heads, d, dtype=spec.dtype, device=dev)
        self.blocks = torch.zeros(self.rows, self.nsel, dtype=torch.int32, device=dev)
        pinned = dict(dtype=torch.int32, pin_memory=True)
        self.blocks_host = torch.zeros(self.rows, self.nsel, **pinned)
        self.counts = torch.zeros(3, dtype=torch.int64)
        # what the host decides for the fetch, in one pinned buffer and its device twin (one copy after the sync):
        # each selected block's cache slot (dest) and, for a miss, its block in the host store (src; -1 for a hit),
        # then the window's length per sequence
        n = self.rows * self.nsel
        self.plan_host = torch.zeros(2 * n + b, **pinned)
        self.plan = torch.zeros(2 * n + b, dtype=torch.int32, device=dev)

        def views(plan):  # dest [rows, nsel], src [rows, nsel], window length [B]
            dest, src, win_len = plan.split((n, n, b))
            return dest.view(self.rows, -1), src.view(self.rows, -1), win_len

        self.dest_host, self.src_host, self.win_len_host = views(self.plan_host)
        self.dest, self.src, self.win_len = views(self.plan)
        self.n2 = torch.full((b,), self.nsel * self.bs, dtype=torch.int32, device=dev)  # rows each head attends
        # numpy views of the pinned buffers, made once: the host's work between the sync and the launch is the
        # step's critical path
        self.host_views = tuple(t.numpy() for t in (self.blocks_host, self.dest_host, self.src_host, self.counts))
        self.retrieved = torch.cuda.Event()
        self.updating = None  # the deferred LRU update of this layer's last step (a Future)
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self.out: torch.Tensor | None = None

    # ---- the captured parts --------------------------------------------------------------------------
    def _retrieve(self) -> None:
        s, bs = self.system, self.bs
        # the hash kernel counts the select's first pass while it writes the scores (in torch the exact one would:
        # slower than the pass)
        work = topk_work(s.topk, self.rows, self.q.device) if s.retriever_kind == "hash" else None
        scores = s.retriever.scores(self.layer, self.q, s.heads, hist=work, pool=bs)  # [B, Hkv, n_blocks]: best tokens
        blocks = select_topk(scores, self.nsel, 0, method=s.topk, work=work)  # ascending
        self.blocks.copy_(blocks.view(self.rows, self.nsel))
        self.blocks_host.copy_(self.blocks, non_blocking=True)

    def _fetch_attend(self) -> None:
        self._attend(self._fetch())

    def _fetch(self) -> torch.Tensor:
        """Copies the LRU's decision in, the missed blocks into their slots; returns the cache rows to attend."""
        s = self.system
        self.plan.copy_(self.plan_host, non_blocking=True)  # dest, src and the window's length
        # [rows, nsel * bs] rows of the cache (a partial last block's padding -1), and each block's flat slot
        idx, flat = block_rows(self.dest, self.blocks, self.bs, self.n_mid, self.cap)
        host = s.host[self.layer].view(-1, self.bs, 2, self.d)  # [rows * n_blocks, bs, 2, D] pinned
        cache = s.cache[self.layer].view(-1, self.bs, 2, self.d)  # [rows * cap, bs, 2, D]
        # hardware.link_gb_s: one slot of the missed blocks' bytes, counted on the GPU from src (>= 0: a miss)
        with moving(s.pacer, count=self.src.view(-1), unit_bytes=host[0].nbytes):
            uva_copy_blocks(host, self.src.view(-1), cache, flat.view(-1))
        return idx

    def _attend(self, idx: torch.Tensor) -> None:
        s, bs, b, hkv, d = self.system, self.bs, self.b, self.hkv, self.d
        idx = idx.view(b, hkv, -1)
        win = s.window[self.layer]  # [B, Hkv, W, 2, D]
        cache = s.cache[self.layer].view(b, hkv, self.cap * bs, 2, d)
        k2 = cache.new_empty(b, idx.shape[2], 0, d)  # every head's second-buffer rows are indexed
        self.out = hybrid_attention(
            self.q,
            (win[:, :, :, 0].transpose(1, 2), win[:, :, :, 1].transpose(1, 2), self.win_len),
            (k2, k2, self.n2),
            (cache[:, :, :, 0].transpose(1, 2), cache[:, :, :, 1].transpose(1, 2), idx),
        )

    def _replay(self, name: str, fn) -> None:
        replay_graph(self.graphs, name, fn, self.pool)

    # ---- one step -------------------------------------------------------------------------------------
    def step(self, q: torch.Tensor, n_win: int) -> torch.Tensor:
        s = self.system
        if self.updating is not None:  # its blocks_host is about to be overwritten, its state read
            with s.phase("cache_mgmt"), host_work(s.step):
                self.updating.result()
            self.updating = None
        with s.phase("retrieval"):
            self.q.copy_(q)
            self._replay("retrieve", self._retrieve)
            self.retrieved.record()
        with s.phase("launch_sync"):
            self.retrieved.synchronize()  # the block ids are on the host
        # after the sync: this layer's last fetch graph, which copied the plan, has run before this retrieve
        self.win_len_host.fill_(n_win)
        lru, (blocks, dest, src, counts) = s.lru[self.layer], self.host_views
        with s.phase("cache_mgmt"), host_work(s.step):
            if s.lru_worker is None:
                lru.access_into(blocks, dest, src, counts)
            else:
                lru.decide_into(blocks, dest, src, counts)
        with s.phase("attention"):  # the fetch's kernels too: one graph (a trace splits them by kernel)
            self._replay("fetch_attend", self._fetch_attend)
        if s.lru_worker is not None:  # the state change beside the fetch and attention, once they are launched
            self.updating = s.lru_worker.submit(lru.update, blocks)
        s.step.host_syncs += 1
        s.step.bytes_d2h += self.blocks_host.nbytes
        lookups, hits, evictions = counts.tolist()
        s.step.lookups += lookups
        s.step.hits += hits
        s.step.bytes_h2d += (lookups - hits) * self.bs * s.spec.row_bytes
        s.evictions += evictions
        return self.out
