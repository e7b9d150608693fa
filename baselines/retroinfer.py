"""RetroInfer-style baseline (docs/systems.md, "RetroInfer-style"; microsoft/RetrievalAttention): KV offloaded to host
memory, a device block cache per (sequence, layer, KV head) managed by an LRU on the CPU.

Per decode step and sparse layer:
  retrieval         top-k middle tokens per KV head with CLO's retriever (hash or exact), mapped to block ids
                    (block = `block_size` consecutive middle tokens of one head) and deduplicated on the device
  launch_sync       the block ids are copied to the host: the launch thread waits for the device (a host sync)
  cache_mgmt        the CPU decides hits and misses and updates each head's LRU (baselines/lru.py)
  transfer_exposed  missed blocks are fetched from host memory into a temporary device buffer (the same transfer
                    engine as CLO) and the admitted ones merged into their cache slots
  attention         window + the selected tokens' rows, read from the cache (hits) or the temporary buffer
Attended tokens, budget and dense layers follow CLO's conventions (OffloadedBaseline), so that with the exact
retriever every system attends exactly the same top-k tokens.

Defaults follow RetroInfer's public code (cache_hub/retroinfer_cache.py of microsoft/RetrievalAttention: a page, our
block, of 8 tokens; a cache of 3x the retrieved clusters' pages); docs/systems.md says where each comes from. By default
we retrieve tokens with CLO's retriever, so "retrieved blocks per step" is ceil(top-k / block_size); a step touching
more distinct blocks than fit admits misses in retrieval order and lets the rest bypass the cache, as RetroInfer's
BufferManager does. `retriever=wave` is its own clustered wave index (baselines/wave_index.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch

from baselines import lru_native
from baselines.lru import BlockLRU, distinct_sorted
from baselines.offloaded import GRAPH_MODES, OffloadedBaseline, sized
from baselines.retroinfer_graphs import LayerGraphs
from baselines.wave_index import WaveRetriever, attend_with_estimate
from kvoffload.errors import ConfigError
from kvoffload.kernels.hash_score import block_max
from kvoffload.kv.interface import KVSpec, host_work, split_host
from kvoffload.offload.budget import split_prompt
from kvoffload.offload.retrieval import (
    RETRIEVERS,
    check_hash_weights,
    load_hash_weights,
    make_retriever,
    metadata_bytes_per_head,
    select_topk,
    topk_work,
)

# block: whole blocks are retrieved, scored by their best token (RetroInfer retrieves whole clusters, so a miss
#        moves only selected tokens); token: the top-k tokens, each pulling in its whole block (for the exact
#        top-k equivalence test; moves up to block_size x the selected bytes)
SELECTIONS = ("block", "token")
# on: the decode step's GPU work in per-layer CUDA graphs between the sync points (baselines/retroinfer_graphs.py);
# off: eager; auto: on where it applies (CUDA, block selection, hash or exact retriever, uva transfer)
# the graph path's LRU, per layer and step: inline, the whole step (decision and state change) between the sync and
# the fetch; deferred, the decision there and the state change in a worker thread beside the GPU's fetch and
# attention, as RetroInfer's thread pool updates its cache (cache_hub/retroinfer_cache.py: batch_access, then sync)
LRU_UPDATES = ("inline", "deferred")


class RetroInfer(OffloadedBaseline):
    name = "retroinfer"

    def __init__(
        self,
        topk_ratio: float = 0.1,
        sink: int = 16,
        recent: int = 64,
        dense_layers: int = 2,
        retriever: str = "hash",
        rbit: int = 256,
        seed: int = 0,
        hash_weights: str | None = None,
        block_size: int = 8,
        cache_multiple: float = 3.0,
        transfer: str = "uva",
        cpu_threads: int | str = "auto",
        uva_programs: int | None = None,
        topk: str = "torch",
        selection: str = "block",
        wave_cluster_size: int = 16,
        wave_segment: int = 8192,
        wave_iters: int = 4,
        wave_estimate: float = 0.232,
        graphs: str = "auto",
        lru_update: str = "inline",
    ) -> None:
        super().__init__(topk_ratio, sink, recent, dense_layers, transfer, cpu_threads, uva_programs, topk)
        if selection not in SELECTIONS:
            raise ConfigError(f"selection={selection!r}; valid: {', '.join(SELECTIONS)}")
        self.selection = selection
        if retriever not in (*RETRIEVERS, "wave"):
            raise ConfigError(f"retriever={retriever!r}; valid: {', '.join(RETRIEVERS)}, wave")
        self.wave = WaveRetriever(0, wave_cluster_size, wave_segment, wave_iters, wave_estimate)  # validates it
        if block_size < 1:
            raise ConfigError(f"block_size={block_size} must be at least 1 token")
        if cache_multiple < 1.0:
            raise ConfigError(
                f"cache_multiple={cache_multiple}: a cache smaller than the blocks one step retrieves "
                f"cannot hold a step's working set; use >= 1 (RetroInfer: 3)"
            )
        check_hash_weights(hash_weights, retriever)
        self.retriever_kind, self.rbit, self.seed, self.hash_weights = retriever, rbit, seed, hash_weights
        self.block_size, self.cache_multiple = block_size, cache_multiple
        self.multiple = cache_multiple  # the allocated cache's (fit_multiple: smaller under a device budget)
        if graphs not in GRAPH_MODES:
            raise ConfigError(f"graphs={graphs!r}; valid: {', '.join(GRAPH_MODES)}")
        self.graphs = graphs
        if lru_update not in LRU_UPDATES:
            raise ConfigError(f"lru_update={lru_update!r}; valid: {', '.join(LRU_UPDATES)}")
        self.lru_update = lru_update
        self.estimating = retriever == "wave" and self.wave.estimate > 0
        self.evictions = 0

    def k_select(self, prompt_len: int) -> int:
        """Rows gathered per KV head and step. Token selection: CLO's budget k (select_budget). Block selection
        attends whole blocks: the n_mid middle tokens make ceil(n_mid / block_size) blocks, the last one partial
        when block_size does not divide n_mid (its padding rows, zeros in the host store, are never scored nor
        attended: the block is scored by its real tokens and attention masks the rest). A step attends
        floor(k / block_size) blocks, or every block when the budget is the whole middle (k = n_mid, top-k 100 %):
        at most k real tokens either way (exactly n_mid at k = n_mid; when the partial block is among the
        floor(k / block_size) selected ones, block_size - n_mid % block_size fewer than the rows gathered).
        Returned: blocks x block_size, above k only at k = n_mid, by the last block's padding."""
        k = super().k_select(prompt_len)
        if self.selection == "block":
            n_mid = split_prompt(prompt_len, self.sink, self.recent)[2]
            k = (math.ceil(n_mid / self.block_size) if k == n_mid else k // self.block_size) * self.block_size
        return k

    def geometry(self, t0: int, multiple: float | None = None) -> tuple[int, int, int]:
        """(blocks per head, blocks retrieved per step if packed, cache slots per head) for a t0-token prompt and a
        cache of `multiple` x a step's blocks (default: the allocated cache's)."""
        n_mid = split_prompt(t0, self.sink, self.recent)[2]
        n_blocks = math.ceil(n_mid / self.block_size)
        per_step = math.ceil(self.k_select(t0) / self.block_size)
        # the 1e-9: fit_multiple's fitting / per_step times per_step can round to just above the integer it was
        return n_blocks, per_step, min(n_blocks, math.ceil((multiple or self.multiple) * per_step - 1e-9))

    def fit_multiple(self, spec: KVSpec) -> float:
        """The cache multiple this run gets: the configured one, or under a device budget that it does not fit
        (KVSpec.gpu_budget_bytes) the largest that fits, down to 1 (one step's blocks; below that a step's misses
        could not all be admitted). Where even 1 does not fit, 1: the allocation refuses it with the bytes of the
        smallest cache RetroInfer could run with. As CLO demotes persistent heads under a budget, RetroInfer runs
        with the cache the budget allows rather than not at all."""
        budget = spec.gpu_budget_bytes
        parts = self.estimate_parts(spec, self.cache_multiple)
        device = split_host(parts).device_bytes
        if budget is None or device <= budget:
            return self.cache_multiple
        _, per_step, cap = self.geometry(spec.prompt_tokens, self.cache_multiple)
        per_slot = parts["cache"] // max(cap, 1)  # bytes of one slot of every sparse layer's heads
        fitting = (budget - (device - parts["cache"])) // max(per_slot, 1)
        if not per_step:
            return self.cache_multiple  # no block cache at all (top-k within sink + recent)
        return fitting / per_step if fitting >= per_step else 1.0

    def host_padding(self, n_mid: int) -> int:
        return -n_mid % self.block_size

    def estimate_parts(self, spec: KVSpec, multiple: float | None = None) -> dict[str, int]:
        t0 = spec.prompt_tokens
        n_mid = split_prompt(t0, self.sink, self.recent)[2]
        n_blocks, _, cap = self.geometry(t0, multiple or self.fit_multiple(spec))
        heads = spec.batch * spec.num_kv_heads
        sparse = spec.num_layers - min(self.dense_layers, spec.num_layers)
        # learned hash weights of another model or another rbit are refused here, before any allocation
        if self.hash_weights is not None and self.retriever_kind == "hash":
            load_hash_weights(self.hash_weights, spec.num_layers, spec.num_kv_heads, spec.head_dim, self.rbit)
        if self.retriever_kind == "wave":
            meta = self.wave.estimate_bytes(heads, n_mid, spec.head_dim, spec.dtype_bytes)
        else:
            meta = heads * metadata_bytes_per_head(
                self.retriever_kind, self.rbit, spec.head_dim, spec.dtype_bytes, n_mid
            )
        return {
            **self.common_estimate(spec),
            "cache": sparse * heads * cap * self.block_size * spec.host_row_bytes,
            "metadata": sparse * meta,
            "host_metadata": sparse * heads * 8 * (n_blocks + 1 + 2 * (cap + 1)) if n_mid else 0,  # no middle: no LRU
        }

    def _allocate(self, spec: KVSpec) -> None:
        self.multiple = self.fit_multiple(spec)
        super()._allocate(spec)
        if self.retriever_kind == "wave":
            w = self.wave
            self.retriever = WaveRetriever(spec.num_layers, w.cluster_size, w.segment, w.iters, w.estimate)
        else:
            self.retriever = make_retriever(
                self.retriever_kind,
                spec.num_layers,
                spec.num_kv_heads,
                spec.head_dim,
                spec.device,
                self.rbit,
                self.seed,
                self.hash_weights,
            )
        self.cache: list[torch.Tensor | None] = [None] * spec.num_layers
        self.lru: list[BlockLRU | None] = [None] * spec.num_layers
        why_not = [
            reason
            for reason, bad in (
                ("a CUDA device", spec.device.type != "cuda"),
                ("selection=block", self.selection != "block"),
                ("retriever=hash or exact", self.retriever_kind not in ("hash", "exact")),  # pq: not yet run in a graph
                ("transfer=uva", self.transfer_kind != "uva"),
                # the graphs attend the cache through hybrid_attention's indexed rows, model dtype only
                ("kv_dtype=model", spec.fp8),
            )
            if bad
        ]
        if self.graphs == "on" and why_not:
            raise ConfigError(f"graphs=on needs {', '.join(why_not)}; use graphs=auto or off")
        self.use_graphs = self.graphs != "off" and not why_not
        self.layer_graphs: dict[int, LayerGraphs] = {}
        # one worker: the layers' deferred LRU updates run in order, one core beside the launching thread
        self.lru_worker = ThreadPoolExecutor(1) if self.use_graphs and self.lru_update == "deferred" else None
        self.graph_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # the LRU's compiled code loaded and its threads started here, not in the first layer's timed prefill
        lru_native.warm(deferred=self.lru_worker is not None)
        on_device = spec.device if self.transfer_kind == "uva" else torch.device("cpu")  # where fill wants indices
        self.fill_heads = torch.zeros(1, dtype=torch.long, device=on_device)
        self.fill_miss = torch.ones(1, 1, dtype=torch.bool, device=on_device)

    def prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.prompt_values = v  # the wave index's estimation zone sums them per cluster (prefill_sparse)
        super().prefill(layer, k, v)
        self.prompt_values = None

    def prefill_sparse(
        self, layer: int, keys_mid: torch.Tensor, n_mid: int, rows: torch.Tensor
    ) -> Callable[[], None] | None:
        spec = self.spec
        if not n_mid:
            return None
        encode = None
        if self.retriever_kind != "wave":  # indexed behind the layer, from the staged rows, as CLO encodes its keys
            encode = partial(self.retriever.index, layer, rows[:, :, :n_mid, 0])
        else:  # the host store cluster by cluster (a cluster is a run of blocks), reordered before its copy
            sink = split_prompt(self.t0, self.sink, self.recent)[0]
            self.retriever.index(layer, keys_mid, self.prompt_values[:, :, sink : sink + n_mid])
            perm = self.retriever.perm[layer][..., None, None].expand(-1, -1, -1, 2, spec.head_dim)
            rows[:, :, :n_mid] = rows[:, :, :n_mid].gather(2, perm)
            self.retriever.perm[layer] = None  # used once: positions are all a step needs
        n_blocks, _, cap = self.geometry(self.t0)
        heads = spec.batch * spec.num_kv_heads  # (sequence, KV head) pairs: one cache and LRU row each
        self.cache[layer] = torch.zeros(
            heads, cap, self.block_size, 2, spec.host_width, dtype=spec.host_dtype, device=spec.device
        )
        self.lru[layer] = BlockLRU(heads, n_blocks, cap, self.cpu_threads, deferred=self.lru_worker is not None)
        return encode

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.estimating and layer not in self.dense and self.retriever.centroids[layer] is not None:
            return self.decode_with_estimate(layer, q, k, v)
        if not self.use_graphs or layer in self.dense or not self.k_select(self.t0):
            return super().decode(layer, q, k, v)
        n_win = self.append_window(layer, k, v)
        if layer not in self.layer_graphs:
            self.layer_graphs[layer] = LayerGraphs(self, layer, self.graph_pool)
        return self.layer_graphs[layer].step(q, n_win)

    def decode_with_estimate(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """retriever=wave with its estimation zone (baselines/wave_index.py): OffloadedBaseline.decode's retrieval
        zone, and the next-best clusters estimated from their centroids, merged by log-sum-exp."""
        n_win = self.append_window(layer, k, v)
        k_sel = self.k_select(self.t0)
        sel, real = self.selected_rows(layer, q, k_sel) if k_sel else (None, None)
        with self.phase("retrieval"):
            if not k_sel:
                self.retriever.scores(layer, q, self.heads)  # the clusters' scores, which rank the zone
            zone = self.retriever.estimation_zone(layer, self.retrieved if k_sel else None)
        with self.phase("attention"):
            win = self.window[layer][:, :, :n_win]
            if sel is None:
                return attend_with_estimate(q, win, None, zone)
            keep = None if real is None else torch.cat([real.new_ones(real.shape[:2] + (n_win,)), real], dim=2)
            return attend_with_estimate(q, torch.cat([win, self.model_rows(sel)], dim=2), keep, zone)

    def selected_rows(self, layer: int, q: torch.Tensor, k_sel: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        spec, bs = self.spec, self.block_size
        cache, lru, host = self.cache[layer], self.lru[layer], self.host[layer]
        rows, cap = cache.shape[:2]
        d, dev = spec.host_width, spec.device  # host rows: packed FP8 under kv_dtype=fp8
        with self.phase("retrieval"):
            # as CLO's: the hash scores' kernel counts the token select's first pass while it writes the scores
            # (other retrievers would count it in torch, slower than the pass itself)
            work = (
                topk_work(self.topk, rows, dev) if self.selection == "token" and self.retriever_kind == "hash" else None
            )
            scores = self.retriever.scores(layer, q, self.heads, hist=work)  # [B, Hkv, n_mid]
            n_mid = scores.shape[-1]
            real = None  # token selection, or whole blocks only: every gathered row is a token
            if self.selection == "block":  # the best token of each block scores the block
                blocks = select_topk(block_max(scores, bs), k_sel // bs, 0, method=self.topk)
                idx = (blocks[..., None] * bs + torch.arange(bs, device=dev)).view(rows, k_sel)
                if n_mid % bs:  # rows past the middle are the last block's padding: masked out of attention
                    real = (idx < n_mid).view(spec.batch, spec.num_kv_heads, k_sel)
            else:
                idx = select_topk(scores, k_sel, 0, method=self.topk, work=work).view(rows, k_sel)
            self.retrieved = idx  # the positions the step attends (the estimation zone is the clusters outside them)
            self.note_middle(layer, idx.view(spec.batch, spec.num_kv_heads, -1), real)
            ublock, uid = distinct_sorted(idx // bs, lru.n_blocks)
        with self.phase("launch_sync"):
            ublock_host = ublock.to(torch.int32).cpu()  # a blocking copy: the launch thread waits for the device
        self.step.host_syncs += 1
        self.step.bytes_d2h += ublock_host.nbytes
        with self.phase("cache_mgmt"), host_work(self.step):
            res = lru.access(ublock_host)
        with self.phase("transfer_exposed"):
            n_miss = res.miss_row.numel()
            temp = torch.empty(n_miss * bs, 2, d, dtype=spec.host_dtype, device=dev)  # the temporary buffer
            if n_miss:
                first = (res.miss_row * lru.n_blocks + res.miss_block) * bs  # row of the block in the flat host store
                tokens = (first[:, None] + torch.arange(bs)).view(1, 1, -1).to(self.fill_heads.device)
                self.transfer.fill(
                    host.view(1, 1, -1, 2, d), self.fill_heads, tokens, self.fill_miss, temp.view(1, 1, -1, 2, d)
                )
                self.transfer.host_syncs = 0  # the indices were already on the host: no second sync happened
                if res.admit_pos.numel():  # merge the admitted blocks into the slots they take
                    where = (res.miss_row[res.admit_pos] * cap + res.admit_slot).to(dev)
                    cache.view(rows * cap, bs, 2, d)[where] = temp.view(n_miss, bs, 2, d)[res.admit_pos.to(dev)]
            slot, miss = res.slot.to(dev), res.miss.to(dev)
        self.step.lookups += res.lookups
        self.step.hits += res.hits
        self.step.bytes_h2d += n_miss * bs * spec.host_row_bytes
        self.evictions += res.evictions
        with self.phase("attention"):  # gather the selected rows: hits from the cache, misses from the buffer
            off = idx % bs
            tok_slot = slot.gather(1, uid)
            at = (torch.arange(rows, device=dev)[:, None] * cap + tok_slot.clamp(min=0)) * bs + off
            sel = cache.view(-1, 2, d)[at]
            if n_miss:
                from_temp = temp[miss.gather(1, uid).clamp(min=0) * bs + off]
                sel = torch.where((tok_slot < 0)[..., None, None], from_temp, sel)
            return sel.view(spec.batch, spec.num_kv_heads, k_sel, 2, d), real

    def memory_parts(self) -> dict[str, int]:
        return {
            **self.common_parts(),
            "cache": sized(self.cache),
            "metadata": self.retriever.metadata_bytes(),
            "host_metadata": sum(x.nbytes for x in self.lru if x is not None),
        }

    def step_device_bytes(self) -> int:
        """OffloadedBaseline's, with the wave index's bytes a step reads (only the estimation zone's value sums)."""
        wave = self.retriever_kind == "wave"
        return super().step_device_bytes() - (
            self.retriever.metadata_bytes() - self.retriever.step_bytes() if wave else 0
        )

    def wave_zones(self) -> dict | None:
        """What a wave-index step attends: the retrieval zone (top-k rows per KV head, of the best clusters, by block
        or token) and the estimation zone (clusters per KV head estimated from their centroids); None without it."""
        if self.retriever_kind != "wave":
            return None
        cent = next((c for c in self.retriever.centroids if c is not None), None)
        clusters = 0 if cent is None else cent.shape[2]
        return {
            "retrieval_rows_per_head": self.k_select(self.t0),
            "clusters_per_head": clusters,
            "estimation_fraction": self.wave.estimate,
            "estimation_clusters_per_head": self.retriever.estimation_clusters(clusters) if self.estimating else 0,
        }

    def describe(self) -> dict:
        n_blocks, per_step, cap = self.geometry(self.t0)
        return {
            "retriever": self.retriever.weights_source,
            "wave_zones": self.wave_zones(),
            "block_size": self.block_size,
            "blocks_per_head": n_blocks,
            "retrieved_blocks_per_step": per_step,
            "cache_blocks_per_head": cap,
            "cache_multiple": self.multiple,
            "cache_multiple_configured": self.cache_multiple,  # more than cache_multiple: cut to the device budget
            "evictions": self.evictions,
            "cpu_threads": self.cpu_threads,
            # the threads the LRU's last step ran on, by layer (a step's lookups decide them: baselines/lru.py)
            "lru_step_threads": sorted(
                {x.step_threads for x in getattr(self, "lru", []) if x and x.backend == "native"}
            ),
            "transfer": self.transfer_kind,
            "uva_programs": self.uva_programs,
            "topk": self.topk,
            "link_gb_s": self.link_gb_s,
            "selection": self.selection,
            "graphs": self.use_graphs,
            "lru_update": "inline" if self.lru_worker is None else "deferred",  # as the steps ran
            "defaults_source": "RetroInfer cache_hub/retroinfer_cache.py (microsoft/RetrievalAttention): "
            "page_size 8, cache = 3 x the retrieved clusters' pages",
            "memory_parts": self.memory_parts(),
        }
