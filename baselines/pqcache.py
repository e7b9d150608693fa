"""PQCache-style baseline (the fourth system of the paper's Figure 2; PQCache, Zhang et al. 2024, its public code
HugoZHL/PQCache): product-quantisation retrieval of top-k tokens, the misses gathered on the CPU, and a small
device cache of whole blocks managed by an LFU on the CPU. Per sparse layer and step:

  retrieval         PQ scores of the prompt's middle (kvoffload/offload/pq_index.py: 2 sub-vectors x 64 centroids a
                    KV head, k-means at prefill), the top-k tokens per KV head, and each sequence's blocks ranked
                    by how many of them they hold (over the KV heads)
  attention         the selected tokens whose block is cached, gathered from the device cache
  launch_sync       the missed tokens and the ranked blocks to the host (the step's one sync)
  transfer_exposed  those tokens gathered by CPU threads from the host store and copied in (the transfer engine's
                    cpu_gather)
  attention         the window and the selected tokens
  cache_mgmt        after attention is launched: the top admit_blocks ranked blocks inserted into the LFU
                    (baselines/lfu.py), the ones it newly places copied whole into their slots, for the steps after
                    (on CUDA read by the GPU from pinned memory on a side stream, as PQCache's block copies run;
                    the layer's next step waits for them)

As PQCache's (vq_method/retrieval_based/cache_manager.py, with vq_pred.py's settings): a block is `block_size`
positions of every KV head of one sequence, the cache holds `cache_tokens` positions a layer, and a step inserts its
top `admit_blocks` blocks. The sink, recent window, dense layers and top-k budget follow CLO's conventions
(OffloadedBaseline), so that with the exact retriever every system attends the same tokens. Eager: the miss gather
sits between GPU work that depends on it, as in PQCache's own step; the cache step runs beside the attention."""

from __future__ import annotations

import contextlib
import math

import torch

from baselines.cpu_fetch import gather_gb_by_threads
from baselines.lfu import BlockLFU
from baselines.offloaded import OffloadedBaseline, sized
from kvoffload.errors import ConfigError
from kvoffload.kv.interface import KVSpec, StepStats, host_work
from kvoffload.offload.budget import split_prompt
from kvoffload.offload.link import paced_copy
from kvoffload.offload.retrieval import make_retriever, metadata_bytes_per_head, select_topk
from kvoffload.offload.transfer import TransferEngine, gather_to_device, to_device

PQCACHE_RETRIEVERS = ("pq", "exact")  # exact: the oracle, for tests and ablations


class PQCache(OffloadedBaseline):
    name = "pqcache"
    hit_unit = "token"

    def __init__(
        self,
        topk_ratio: float = 0.1,
        sink: int = 16,
        recent: int = 64,
        dense_layers: int = 2,
        retriever: str = "pq",
        seed: int = 0,
        block_size: int = 128,
        cache_tokens: int = 4096,
        admit_blocks: int = 32,
        transfer: str = "cpu_gather",
        cpu_threads: int | str = "auto",
        topk: str = "radix",
    ) -> None:
        super().__init__(topk_ratio, sink, recent, dense_layers, transfer, cpu_threads, None, topk)
        if retriever not in PQCACHE_RETRIEVERS:
            raise ConfigError(f"retriever={retriever!r}; valid: {', '.join(PQCACHE_RETRIEVERS)}")
        if block_size < 1:
            raise ConfigError(f"block_size={block_size} must be at least 1 token")
        if cache_tokens < 0 or admit_blocks < 0:
            raise ConfigError(f"cache_tokens={cache_tokens} and admit_blocks={admit_blocks} must be >= 0")
        self.retriever_kind, self.seed = retriever, seed
        self.block_size, self.cache_tokens, self.admit_blocks = block_size, cache_tokens, admit_blocks
        self.evictions = 0
        self.ranked: tuple[torch.Tensor, torch.Tensor] | None = None  # a layer's ranked blocks, for its cache step
        self.gathered_bytes = 0  # the step's misses gathered by CPU threads (its floor's host part, with the LFU)
        self.last_gather: torch.Tensor | None = None  # the last such gather's rows: the floor's access pattern
        self.gather_alone: dict[int, float] = {}  # GB/s of that gather alone, by thread count, measured once

    def geometry(self, t0: int) -> tuple[int, int]:
        """(blocks of a sequence's middle, cache slots of a sequence) for a t0-token prompt."""
        n_blocks = math.ceil(split_prompt(t0, self.sink, self.recent)[2] / self.block_size)
        return n_blocks, min(self.cache_tokens // self.block_size, n_blocks)

    def host_padding(self, n_mid: int) -> int:
        return -n_mid % self.block_size  # whole blocks, for the cache's block copies

    def estimate_parts(self, spec: KVSpec) -> dict[str, int]:
        n_mid = split_prompt(spec.prompt_tokens, self.sink, self.recent)[2]
        n_blocks, cap = self.geometry(spec.prompt_tokens)
        b, hkv = spec.batch, spec.num_kv_heads
        sparse = spec.num_layers - min(self.dense_layers, spec.num_layers)
        meta = metadata_bytes_per_head(self.retriever_kind, 0, spec.head_dim, spec.dtype_bytes, n_mid) if n_mid else 0
        return {
            **self.common_estimate(spec),
            "cache": sparse * b * cap * hkv * self.block_size * spec.host_row_bytes,
            "metadata": sparse * b * hkv * meta,
            "slot_map": sparse * b * n_blocks * 8,
            "host_metadata": sparse * 8 * (b * n_blocks + 3 * b * cap + 2 * b) if n_mid else 0,
        }

    def _allocate(self, spec: KVSpec) -> None:
        super()._allocate(spec)
        self.retriever = make_retriever(
            self.retriever_kind, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.device, 0, self.seed
        )
        L = spec.num_layers
        self.cache: list[torch.Tensor | None] = [None] * L  # [B, cap, Hkv, block, 2, D]
        self.slot_map: list[torch.Tensor | None] = [None] * L  # [B, n_blocks] each block's slot, -1: not cached
        self.lfu: list[BlockLFU | None] = [None] * L
        BlockLFU(1, 1, 1).insert(torch.zeros(1, 1, dtype=torch.long))  # compiled here, not in the first timed step
        self.fill_heads = torch.zeros(1, dtype=torch.long, device=spec.device)  # the uva gathers' one "head"
        self.fill_miss = torch.ones(1, 1, dtype=torch.bool, device=spec.device)
        cuda = spec.device.type == "cuda"
        # on CUDA the admitted blocks move as PQCache's do, by the GPU from pinned memory on a side stream, with no
        # CPU gather: its per-block DMA, for a head-major store whose block is a run of rows per KV head
        self.block_copy = TransferEngine("uva", 1, spec.device, pacer=self.pacer) if cuda else None
        self.side = torch.cuda.Stream(spec.device) if cuda else None
        self.admitted: list[torch.cuda.Event | None] = [None] * L  # a layer's last cache step, done on the side

    def prefill_sparse(self, layer: int, keys_mid: torch.Tensor, n_mid: int, rows: torch.Tensor) -> None:
        if not n_mid:
            return
        spec = self.spec
        self.retriever.index(layer, keys_mid)
        n_blocks, cap = self.geometry(self.t0)
        b, hkv, bs = spec.batch, spec.num_kv_heads, self.block_size
        # host rows as the store holds them (packed FP8 under kv_dtype=fp8)
        self.cache[layer] = torch.zeros(b, cap, hkv, bs, 2, spec.host_width, dtype=spec.host_dtype, device=spec.device)
        self.slot_map[layer] = torch.full((b, n_blocks), -1, dtype=torch.long, device=spec.device)
        self.lfu[layer] = BlockLFU(b, n_blocks, cap)

    def selected_rows(self, layer: int, q: torch.Tensor, k_sel: int) -> tuple[torch.Tensor, None]:
        spec, bs = self.spec, self.block_size
        b, hkv, d = spec.batch, spec.num_kv_heads, spec.host_width
        cache, dev = self.cache[layer], spec.device
        cap = cache.shape[1]
        if self.admitted[layer] is not None:  # the last step's blocks and slot map in place before they are read
            torch.cuda.current_stream().wait_event(self.admitted[layer])
        with self.phase("retrieval"):
            idx = select_topk(self.retriever.scores(layer, q, self.heads), k_sel, 0, method=self.topk)  # [B, Hkv, k]
            self.note_middle(layer, idx)
            blk = idx // bs
            slot = self.slot_map[layer].gather(1, blk.view(b, -1)).view_as(idx)
            miss = slot < 0
            ranked = self.rank_blocks(layer, blk) if cap else None
        with self.phase("attention"):  # the cached tokens, gathered from their blocks' slots
            seq = torch.arange(b, device=dev)[:, None, None]
            head = torch.arange(hkv, device=dev)[None, :, None]
            at = ((seq * cap + slot.clamp(min=0)) * hkv + head) * bs + idx % bs
            sel = cache.view(-1, 2, d)[at] if cap else torch.empty(b, hkv, k_sel, 2, d, dtype=cache.dtype, device=dev)
        with self.phase("launch_sync"):  # the step's sync: the missed tokens and the ranked blocks, on the host
            miss_host, idx_host = miss.cpu(), idx.cpu()
            ranked = None if ranked is None else (ranked.values.cpu(), ranked.indices.cpu())  # the GPU idle by now
        self.step.host_syncs += 1
        with self.phase("transfer_exposed"):  # the missed tokens by the CPU gather and a copy
            mb, mh, mj = miss_host.nonzero(as_tuple=True)
            if mb.numel():
                rows = (mb * hkv + mh) * self.host[layer].shape[2] + idx_host[mb, mh, mj]
                at = to_device((mb * hkv + mh) * idx.shape[2] + mj, dev)  # where each missed row goes in sel
                sel.view(-1, 2, d)[at] = self.fetch_rows(layer, rows)
                if self.transfer_kind == "cpu_gather":
                    self.gathered_bytes += rows.numel() * spec.host_row_bytes
                    self.last_gather = rows
        self.step.lookups += idx.numel()
        self.step.hits += idx.numel() - mb.numel()
        self.step.bytes_d2h += miss.numel() * (1 + idx.element_size())  # the miss mask and the selected tokens
        self.step.bytes_d2h += 0 if ranked is None else ranked[0].nbytes + ranked[1].nbytes
        self.step.bytes_h2d += mb.numel() * (spec.host_row_bytes + 3 * 8)  # the rows and where they go
        self.ranked = ranked  # the cache step waits until this layer's attention is launched (decode)
        return sel, None

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """OffloadedBaseline's, then the cache step: its CPU work beside the layer's attention on the GPU, as
        PQCache's runs on a side stream (the blocks it places serve the next steps only)."""
        self.ranked = None
        out = super().decode(layer, q, k, v)
        if self.ranked is not None:
            self.update_cache(layer, *self.ranked)
        return out

    def end_step(self) -> StepStats:
        """Its floor's host part holds, beside the LFU's time, the misses' CPU gather: the gathered bytes at the
        gather's bandwidth alone (cpu_fetch.gather_gb_by_threads over every layer's store with a step's own rows, in
        one index_select as this system gathers; measured once, the best thread count), as InfiniGen-style's floor."""
        if self.gathered_bytes:
            if not self.gather_alone:
                rows = self.last_gather
                staging = torch.empty(rows.numel(), 2 * self.spec.host_width, dtype=self.spec.host_dtype)
                self.gather_alone = gather_gb_by_threads(
                    self.host_store_rows(), staging, self.cpu_threads, rows, len(rows)
                )
            self.step.host_work_ms += self.gathered_bytes / (max(self.gather_alone.values()) * 1e6)
            self.gathered_bytes = 0
        return super().end_step()

    def fetch_rows(self, layer: int, rows: torch.Tensor, engine: TransferEngine | None = None) -> torch.Tensor:
        """rows [n] of the layer's flat host store (on the host) -> those rows [n, 2, D] on the device: cpu_gather
        (PQCache's path) by CPU threads into pinned staging and one copy, uva by the GPU reading the host store."""
        spec, engine = self.spec, engine or self.transfer
        if engine.kind == "cpu_gather" or spec.device.type != "cuda":
            return gather_to_device(self.host[layer], rows, engine.threads, spec.device, engine.pacer)
        out = torch.empty(1, 1, rows.numel(), 2, spec.host_width, dtype=spec.host_dtype, device=spec.device)
        host = self.host[layer].view(1, 1, -1, 2, spec.host_width)
        engine.fill(host, self.fill_heads, to_device(rows, spec.device).view(1, 1, -1), self.fill_miss, out)
        return out[0, 0]

    def rank_blocks(self, layer: int, blk: torch.Tensor):
        """Each sequence's blocks by how many of the step's selected tokens they hold (over the KV heads): the top
        admit_blocks (values: the counts, indices: the blocks), on the device, as PQCache ranks them."""
        b, n_blocks = self.slot_map[layer].shape
        ones = torch.ones(blk.numel() // b, device=blk.device).expand(b, -1)
        counts = torch.zeros(b, n_blocks, device=blk.device).scatter_add_(1, blk.view(b, -1), ones)
        return counts.topk(min(self.admit_blocks, n_blocks), dim=1)

    def update_cache(self, layer: int, best: torch.Tensor, ids: torch.Tensor) -> None:
        """PQCache's cache step, from the ranked blocks on the host (best [B, A] counts, ids [B, A] blocks): those
        with any selected token into the LFU, and the blocks it newly places copied in whole from the host store, for
        the steps after."""
        spec, bs = self.spec, self.block_size
        hkv, d = spec.num_kv_heads, spec.host_width
        n_blocks = self.slot_map[layer].shape[1]
        with self.phase("cache_mgmt"):
            with host_work(self.step):
                ids = torch.where(best > 0, ids, -1)
                slots, new, evictions = self.lfu[layer].insert(ids)
            self.evictions += evictions
            seq, col = new.nonzero(as_tuple=True)
            block_slot = torch.from_numpy(self.lfu[layer].block_slot)
            if self.side is not None:  # behind this layer's attention, which has read the slots being replaced
                self.side.wait_stream(torch.cuda.current_stream())
                block_slot = block_slot.pin_memory()
            with torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext():
                if seq.numel():  # every KV head's rows of each newly placed block
                    head, off = torch.arange(hkv)[None, :, None], torch.arange(bs)[None, None, :]
                    first = ((seq[:, None, None] * hkv + head) * n_blocks + ids[seq, col][:, None, None]) * bs
                    rows = self.fetch_rows(layer, (first + off).flatten(), self.block_copy).view(-1, hkv, bs, 2, d)
                    self.cache[layer][to_device(seq, spec.device), to_device(slots[seq, col], spec.device)] = rows
                    self.step.bytes_h2d += rows.shape[0] * hkv * bs * spec.host_row_bytes
                # as PQCache's block_pos_record: the whole map, each step
                paced_copy(self.pacer, self.slot_map[layer], block_slot)  # bytes_h2d counts it: paced too
                self.step.bytes_h2d += self.slot_map[layer].nbytes
            if self.side is not None:
                self.admitted[layer] = self.side.record_event()

    def memory_parts(self) -> dict[str, int]:
        return {
            **self.common_parts(),
            "cache": sized(self.cache),
            "metadata": self.retriever.metadata_bytes(),
            "slot_map": sized(self.slot_map),
            "host_metadata": sum(x.nbytes() for x in self.lfu if x is not None),
        }

    def describe(self) -> dict:
        n_blocks, cap = self.geometry(self.t0)
        return {
            "retriever": self.retriever.weights_source,
            "block_size": self.block_size,
            "blocks_per_sequence": n_blocks,
            "cache_blocks_per_sequence": cap,
            "admit_blocks": self.admit_blocks,
            "evictions": self.evictions,
            "cpu_threads": self.cpu_threads,
            "transfer": self.transfer_kind,
            "cpu_gather_gb_s": {  # what the floor's host part divides the gathered bytes by: the best of these
                "alone_by_threads": {t: round(x, 2) for t, x in self.gather_alone.items()},
            },
            "topk": self.topk,
            "link_gb_s": self.link_gb_s,
            "defaults_source": "PQCache vq_pred.py (HugoZHL/PQCache): cache_block_size 128, global_cache_size "
            "4096, cache_topk 32; 2 sub-vectors x 6 bits",
            "memory_parts": self.memory_parts(),
        }
