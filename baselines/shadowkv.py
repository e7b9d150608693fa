"""ShadowKV-style baseline (ShadowKV, Sun et al. 2024; its public code bytedance-seed/ShadowKV): the keys kept as a
low-rank factorisation of their pre-RoPE values on the device, the values offloaded to host memory, and per step
the chunks whose landmarks score highest rebuilt (keys) and fetched (values). Per sparse layer:

  prefill    the pre-RoPE keys' truncated SVD (U [B, T, rank], SV [B, Hkv, rank, D], one a sequence, KV heads
             side by side); the context split into chunks of `chunk_size`; a landmark per chunk (its mean post-RoPE
             key); the `outliers` chunks worst stood for by their landmark kept exact on the device with the local
             window (the last chunks); the context's values to host memory (pinned on CUDA)
  retrieval  each query head's softmax over the landmarks, the maximum over the query group, the top `select`
  cache_mgmt chunks selected at the layer's last step keep their rows; the others' keys are rebuilt from U and
             SV and rotated at their positions
  transfer   the others' values, host to device
  attention  over the window (local and generated tokens), the outliers and the selected chunks

Geometry and arithmetic: baselines/shadowkv_parts.py. docs/systems.md, "ShadowKV-style", gives the defaults' sources
and what differs from the original."""

from __future__ import annotations

import torch

from baselines.fullattn import dense_decode_attention
from baselines.offloaded import sized
from baselines.shadowkv_parts import (
    Geometry,
    chunk_scores,
    geometry,
    landmarks_and_outliers,
    low_rank,
    rebuild,
    slot_assignment,
    unrotate,
)
from kvoffload.errors import ConfigError
from kvoffload.kernels.fp8_rows import dequantize_rows
from kvoffload.kv.interface import KVOffloadSystem, KVSpec
from kvoffload.offload import host as host_memory
from kvoffload.offload.budget import check_budget
from kvoffload.offload.layers import DenseLayers, window_positions
from kvoffload.offload.link import link_pacer
from kvoffload.offload.transfer import TransferEngine, to_device

PATHS = ("auto", "reference", "static")


class ShadowKV(KVOffloadSystem):
    name = "shadowkv"
    kv_dtypes = ("model", "fp8")  # fp8: its host store of values
    hit_unit = "chunk"  # a selected chunk of one KV head: a hit if the layer's last step selected it too

    def __init__(
        self,
        budget: int = 2048,
        topk_ratio: float | None = None,
        rank: int = 160,
        chunk_size: int = 8,
        outlier_chunks: int | None = None,
        local_chunks: int = 4,
        dense_layers: int = 0,
        path: str = "auto",
    ) -> None:
        super().__init__()
        if topk_ratio is not None:
            check_budget(topk_ratio, 0, 0, dense_layers)
        if chunk_size < 1 or rank < 1:
            raise ConfigError(f"chunk_size={chunk_size} and rank={rank} must be at least 1")
        if topk_ratio is None and (budget < chunk_size or budget % chunk_size):
            raise ConfigError(f"budget={budget} must be a positive multiple of chunk_size={chunk_size}")
        bad = [f"{k}={v}" for k, v in (("local_chunks", local_chunks), ("outlier_chunks", outlier_chunks),
                                       ("dense_layers", dense_layers)) if v is not None and v < 0]  # fmt: skip
        if bad:
            raise ConfigError(f"{', '.join(bad)}: must be >= 0")
        self.budget, self.topk_ratio, self.rank, self.chunk = budget, topk_ratio, rank, chunk_size
        self.outlier_chunks, self.local_chunks, self.dense_layers = outlier_chunks, local_chunks, dense_layers
        if path not in PATHS:
            raise ConfigError(f"path={path!r}; valid: {', '.join(PATHS)}")
        self.path = path
        self.g: Geometry | None = None
        self.missed = self.stepped = 0  # chunks rebuilt and fetched, steps x sparse layers: the floor's U rows

    def geometry(self, prompt: int) -> Geometry:
        return geometry(prompt, self.chunk, self.local_chunks, self.budget, self.topk_ratio, self.outlier_chunks)

    def check_shapes(self, spec: KVSpec) -> None:
        cols = spec.num_kv_heads * spec.head_dim  # one SVD a layer of the KV heads side by side: its rank's bound
        if self.rank > cols:
            raise ConfigError(
                f"rank={self.rank} exceeds the keys' {cols} columns a layer ({spec.num_kv_heads} KV heads x head dim "
                f"{spec.head_dim}); valid: 1..{cols}"
            )
        if self.dense_layers > spec.num_layers:
            raise ConfigError(f"dense_layers={self.dense_layers} exceeds the model's {spec.num_layers} layers")

    def always_attended(self, prompt_len: int) -> tuple[int, int]:
        return 0, self.geometry(prompt_len).local

    # ---- memory -------------------------------------------------------------------------------------------
    def estimate_parts(self, spec: KVSpec) -> dict[str, int]:
        self.check_shapes(spec)
        t0, g = spec.prompt_tokens, self.geometry(spec.prompt_tokens)
        b, h, d, e = spec.batch, spec.num_kv_heads, spec.head_dim, spec.dtype_bytes
        sparse = spec.num_layers - self.dense_layers
        heads = sparse * b * h
        return {
            "window": heads * (g.local + spec.max_len - t0) * spec.row_bytes,
            "dense_layers": self.dense_layers * b * h * spec.max_len * spec.row_bytes,
            "outliers": heads * g.outliers * g.chunk * spec.row_bytes,
            "landmarks": heads * (g.landmarks * (d * e + 8) + g.outliers * 8),  # landmarks, their chunks, outliers'
            "low_rank": sparse * b * (t0 * self.rank + h * self.rank * d) * e,
            "selected": heads * g.select * (g.chunk * spec.row_bytes + 8),  # rows and the chunks they hold
            "host": heads * g.context_tokens * spec.host_row_bytes // 2,  # the context's values (packed FP8: fp8)
        }

    def pinned_host_bytes(self, spec: KVSpec) -> int:
        """One store a sparse layer, each pinned in torch's power-of-two blocks."""
        host = self.estimate_parts(spec)["host"]
        sparse = spec.num_layers - self.dense_layers
        return sparse * host_memory.pinned_bytes(host // sparse) if sparse else 0

    def memory_parts(self) -> dict[str, int]:
        return {
            "window": sized(self.window),
            "dense_layers": self.dense.nbytes(),
            "outliers": sized(self.outlier_kv),
            "landmarks": sized(self.landmarks) + sized(self.landmark_chunks) + sized(self.outlier_ids),
            "low_rank": sized(self.U) + sized(self.SV),
            "selected": sized(self.sel_k) + sized(self.sel_v) + sized(self.selected_chunks),
            "host": sized(self.host_v),
        }

    # ---- allocation and prefill ------------------------------------------------------------------------------
    def _allocate(self, spec: KVSpec) -> None:
        self.check_shapes(spec)
        if spec.rope_inv_freq is None or 2 * len(spec.rope_inv_freq) != spec.head_dim:
            raise ConfigError("system=shadowkv rebuilds keys at their positions: KVSpec.rope_inv_freq must hold the "
                              "model's rotary frequencies (head_dim / 2 of them)")  # fmt: skip
        self.inv_freq = torch.tensor(spec.rope_inv_freq, dtype=torch.float32, device=spec.device)
        self.dense = DenseLayers(spec, self.dense_layers)
        self.static = self.path == "static" or (self.path == "auto" and spec.device.type == "cuda")
        # the static path's value fetch: on CUDA the GPU reads the missed chunks over UVA (no CPU gather, no sync)
        self.pacer = link_pacer(spec)  # hardware.link_gb_s: the fetch and the prefill's copy at the cap
        self.transfer = TransferEngine("uva", 1, spec.device, pacer=self.pacer)
        self.counts = torch.zeros(2, dtype=torch.long, device=spec.device)  # the static path's lookups, misses
        names = ("window", "outlier_kv", "landmarks", "landmark_chunks", "outlier_ids", "U", "SV", "sel_k", "sel_v")
        for n in (*names, "selected_chunks", "host_v"):
            setattr(self, n, [None] * spec.num_layers)
        self.t0 = 0
        if spec.prompt_len is not None:  # pinned before the prefill, as the other offloading systems' stores
            for layer in range(self.dense_layers, spec.num_layers):
                self.buffers(layer, spec.prompt_len)

    def buffers(self, layer: int, t0: int) -> Geometry:
        """The layer's buffers for a t0-token prompt (allocated once)."""
        spec, g = self.spec, self.geometry(t0)
        if self.host_v[layer] is not None and self.g == g:
            return g
        self.g, self.t0 = g, t0
        b, h, d, dev, dt = spec.batch, spec.num_kv_heads, spec.head_dim, spec.device, spec.dtype

        def kv(rows: int) -> torch.Tensor:
            return torch.zeros(b, h, rows, 2, d, dtype=dt, device=dev)

        self.window[layer] = kv(g.local + spec.max_len - t0)
        self.outlier_kv[layer] = kv(g.outliers * g.chunk)
        self.landmarks[layer] = torch.zeros(b, h, g.landmarks, d, dtype=dt, device=dev)
        self.landmark_chunks[layer] = torch.zeros(b, h, g.landmarks, dtype=torch.long, device=dev)
        self.outlier_ids[layer] = torch.zeros(b, h, g.outliers, dtype=torch.long, device=dev)
        self.U[layer] = torch.zeros(b, t0, self.rank, dtype=dt, device=dev)
        self.SV[layer] = torch.zeros(b, h, self.rank, d, dtype=dt, device=dev)
        self.sel_k[layer] = torch.zeros(b, h, g.select * g.chunk, d, dtype=dt, device=dev)
        self.sel_v[layer] = torch.zeros(b, h, g.select * g.chunk, d, dtype=dt, device=dev)  # a chunk's values in a row
        self.selected_chunks[layer] = torch.full((b, h, g.select), -1, dtype=torch.long, device=dev)
        # kv_dtype=fp8: each value packed with its scale (fp8_rows.py, one half of a row), dequantised on arrival
        shape, pin = (b, h, g.context_tokens, spec.host_width), dev.type == "cuda"
        self.host_v[layer] = host_memory.host_buffer(shape, spec.host_dtype, pin, "a layer's")
        return g

    def prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if layer in self.dense:
            self.dense.prefill(layer, torch.stack([k, v], dim=3))
            return
        t0 = k.shape[2]
        g = self.buffers(layer, t0)
        n, c, d = g.context_tokens, g.chunk, k.shape[-1]
        win = self.window[layer]
        win[:, :, : g.local, 0], win[:, :, : g.local, 1] = k[:, :, n:], v[:, :, n:]
        U, SV = low_rank(unrotate(k, self.inv_freq), self.rank)  # over the whole prompt, as the original's
        self.U[layer].copy_(U)
        self.SV[layer].copy_(SV)
        del U, SV
        self.selected_chunks[layer].fill_(-1)  # nothing selected yet: the first step fetches every chunk
        if not g.context:
            return
        lm, chunks, out = landmarks_and_outliers(k[:, :, :n], c, g.outliers)
        self.landmarks[layer].copy_(lm)
        self.landmark_chunks[layer].copy_(chunks)
        self.outlier_ids[layer].copy_(out)
        b, h = k.shape[:2]
        at = out[..., None, None].expand(-1, -1, -1, c, d)
        for j, x in enumerate((k, v)):
            rows = x[:, :, :n].reshape(b, h, g.context, c, d).gather(2, at)
            self.outlier_kv[layer][:, :, :, j] = rows.reshape(b, h, g.outliers * c, d)
        # on the device -> host clock under a cap; under kv_dtype=fp8 each value row quantised on its way, a bounded
        # number at a time. The static path's gathers read the store on the same stream, after the copy; the
        # reference path reads it on the host
        host_memory.copy_rows(self.pacer, self.host_v[layer][..., None, :], v[:, :, :n, None])
        if not self.static and self.spec.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    # ---- decode ---------------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        super().begin_step()
        self.dense.begin_step(self.length)

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if layer in self.dense:
            with self.phase("attention"):
                return self.dense.decode(layer, q, k, v, self.position)
        g = self.g
        n_win = g.local + self.length - self.t0 + 1
        self.window[layer][:, :, n_win - 1] = torch.stack([k, v], dim=2)
        win, out = self.window[layer][:, :, :n_win], self.outlier_kv[layer]
        keys, values = [win[:, :, :, 0], out[:, :, :, 0]], [win[:, :, :, 1], out[:, :, :, 1]]
        if g.select:
            with self.phase("retrieval"):
                top = chunk_scores(q, self.landmarks[layer]).topk(g.select, dim=-1).indices
                chunks = self.landmark_chunks[layer].gather(2, top)  # [B, Hkv, select]
            (self.refill_static if self.static else self.refill)(layer, chunks)
            keys.append(self.sel_k[layer])
            values.append(self.sel_v[layer])
        self.note(layer)
        with self.phase("attention"):
            return dense_decode_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2))

    def refill(self, layer: int, chunks: torch.Tensor) -> None:
        """The reference: the selected buffers := the rows of `chunks` [B, Hkv, select] in their order: a chunk the
        last step selected too keeps its rows (moved on the device to its new place, as the original's), the others'
        keys are rebuilt and their values fetched, found by data-dependent indexing."""
        spec, g = self.spec, self.g
        b, h, s = chunks.shape
        c, d = g.chunk, spec.head_dim
        buf = torch.stack([self.sel_k[layer], self.sel_v[layer]], dim=3).view(b, h, s, c, 2, d)
        with self.phase("cache_mgmt"):
            same = chunks[..., :, None] == self.selected_chunks[layer][..., None, :]  # [B, Hkv, select, select]
            hit = same.any(dim=-1)
            src = same.to(torch.uint8).argmax(dim=-1)
            new = buf.gather(2, src[..., None, None, None].expand(-1, -1, -1, c, 2, d))
            seq, head, slot = (~hit).nonzero(as_tuple=True)
            pos = chunks[seq, head, slot][:, None] * c + torch.arange(c, device=chunks.device)  # [m, c]
            new[seq, head, slot, :, 0] = rebuild(self.U[layer], self.SV[layer], seq, head, pos, self.inv_freq).to(
                spec.dtype
            )
        with self.phase("transfer_exposed"):  # plain indexing of the host store (a CPU gather and a copy on CUDA)
            host = self.host_v[layer]
            hs, hh, hp = (x.to(host.device) for x in (seq, head, pos))
            fetched = to_device(host[hs[:, None], hh[:, None], hp], spec.device)
            new[seq, head, slot, :, 1] = self.values_of(fetched)
        self.sel_k[layer].copy_(new[..., 0, :].view(b, h, s * c, d))
        self.sel_v[layer].copy_(new[..., 1, :].view(b, h, s * c, d))
        self.selected_chunks[layer].copy_(chunks)
        m = seq.numel()
        self.step.lookups += chunks.numel()
        self.step.hits += chunks.numel() - m
        self.step.bytes_h2d += m * c * spec.host_row_bytes // 2
        self.missed += m
        self.stepped += 1

    def refill_static(self, layer: int, chunks: torch.Tensor) -> None:
        """Fixed shapes and no host sync (CUDA's path; path=static on the CPU): the selected buffers as a cache whose
        slots keep their chunk while it stays selected (slot_assignment); the freed slots' keys rebuilt (every slot's
        is computed and the kept ones' discarded: fixed shapes), their values read from the host store by the GPU over
        UVA, a chunk's values one row (only the freed slots' are read)."""
        spec, g = self.spec, self.g
        b, h, s = chunks.shape
        c, d, dev = g.chunk, spec.head_dim, chunks.device
        with self.phase("cache_mgmt"):
            held, miss = slot_assignment(self.selected_chunks[layer], chunks)
            pos = held[..., None] * c + torch.arange(c, device=dev)  # [B, Hkv, select, c]
            seq = torch.arange(b, device=dev)[:, None, None].expand(b, h, s).reshape(-1)
            head = torch.arange(h, device=dev)[None, :, None].expand(b, h, s).reshape(-1)
            k = rebuild(self.U[layer], self.SV[layer], seq, head, pos.view(-1, c), self.inv_freq)
            fresh = miss[..., None, None].expand(b, h, s, c, 1).reshape(b, h, s * c, 1)  # no sync (repeat_interleave)
            self.sel_k[layer].copy_(torch.where(fresh, k.view(b, h, s * c, d).to(spec.dtype), self.sel_k[layer]))
        with self.phase("transfer_exposed"):
            w = spec.host_width  # a value's elements (bytes under kv_dtype=fp8)
            host = self.host_v[layer].view(b, h, g.context, 2, c * w // 2)
            heads = torch.arange(h * s, device=dev) // s  # each (head, slot) a "head" of the gather, with its miss
            if not spec.fp8:
                slots = self.sel_v[layer].view(b, h * s, 1, 2, c * w // 2)
                self.transfer.fill(host, heads, held.view(b, h * s, 1), miss.view(b, h * s), slots)
            else:  # the packed values gathered, then dequantised into the freed slots (docs/fp8.md: not in registers)
                packed = torch.zeros(b, h * s, 1, 2, c * w // 2, dtype=torch.uint8, device=dev)
                self.transfer.fill(host, heads, held.view(b, h * s, 1), miss.view(b, h * s), packed)
                values = self.values_of(packed.view(b, h, s * c, w))
                self.sel_v[layer].copy_(torch.where(fresh, values, self.sel_v[layer]))
        self.selected_chunks[layer].copy_(held)
        self.counts[0] += chunks.numel()
        self.counts[1] += miss.sum()
        self.stepped += 1

    def values_of(self, fetched: torch.Tensor) -> torch.Tensor:
        """Values as the host store holds them [..., host_width] -> in the model's dtype [..., D]."""
        return dequantize_rows(fetched[..., None, :], self.spec.dtype)[..., 0, :] if self.spec.fp8 else fetched

    def end_step(self):
        if self.static:  # the static path's counts, read once a step
            lookups, misses = self.counts.tolist()
            self.counts.zero_()
            self.step.lookups += lookups
            self.step.hits += lookups - misses
            self.step.bytes_h2d += misses * self.g.chunk * self.spec.host_row_bytes // 2
            self.missed += misses
        return super().end_step()

    def note(self, layer: int) -> None:
        """The prompt positions attended: the local window, the outlier chunks and the selected chunks."""
        if self.selections is None:
            return
        g = self.g
        b, h = self.outlier_ids[layer].shape[:2]
        ar = torch.arange(g.chunk, device=self.spec.device)
        chunks = torch.cat([self.outlier_ids[layer], self.selected_chunks[layer]], dim=2)
        pos = (chunks[..., None] * g.chunk + ar).flatten(2)
        window = window_positions(self.t0, 0, g.local, pos.device).expand(b, h, -1)
        self.note_selection(layer, torch.cat([window, pos], dim=2))

    def step_device_bytes(self) -> int:
        """Per step: the attended rows (window, outliers, selected), the landmarks and their chunks, SV, and the U
        rows of the chunks rebuilt (their mean over the steps so far); the dense layers."""
        spec, g = self.spec, self.g
        heads = (spec.num_layers - self.dense_layers) * spec.batch * spec.num_kv_heads
        rows = g.local + self.length - self.t0 + 1 + (g.outliers + g.select) * g.chunk
        e = spec.dtype_bytes
        rebuilt = self.missed / max(self.stepped, 1) * g.chunk * self.rank * e
        per_layer = spec.batch * spec.num_kv_heads * self.rank * spec.head_dim * e + rebuilt
        meta = heads * g.landmarks * (spec.head_dim * e + 8)
        sparse = spec.num_layers - self.dense_layers
        return int(heads * rows * spec.row_bytes + meta + sparse * per_layer) + self.dense.step_bytes(self.length)

    def describe(self) -> dict:
        g = self.g
        return {
            "geometry": None if g is None else {**vars(g), "landmarks": g.landmarks},
            "rank": self.rank,
            "rebuilt_chunks_per_layer_step": self.missed / max(self.stepped, 1),
            "link_gb_s": None if self.g is None else self.spec.link_bytes_per_s / 1e9,  # what its floor divides by
            "defaults_source": "bytedance-seed/ShadowKV models/kv_cache.py (ShadowKVCache_CPU): sparse_budget 2048, "
            "rank 160, chunk_size 8, local_chunk 4, outlier_chunk (sparse_budget // 1024) * 24",
            "memory_parts": self.memory_parts(),
        }
