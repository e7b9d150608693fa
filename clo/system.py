"""CLO (docs/systems.md, "CLO"): a head-wise approximate GPU cache keyed on query similarity, importance-aware
thresholds, persistent heads + one-layer-ahead speculative prefetch, and a transfer path with no CPU gather.

Where each token's K/V lives, per layer at or above `dense_layers` (below it: dense attention, full KV on
the device):
  host    the whole prompt, head-major [B, Hkv, T0, 2, D] (pinned on CUDA)
  window  sink + recent prompt tokens, and every generated token (device)
  slots   per cached KV head, the top-k middle rows selected for its query label (device)
  persist the full prompt KV of the layer's persistent heads (device)

One decode step, per sparse layer l (docs/systems.md, "The decode step"):
  prepare(l, q_spec)  during layer l-1: `ahead` runs `select` (lookup, then top-k for the heads that missed)
                      on the side stream and `move` (their rows into their slots) on the copy stream
  decode(l, q, k, v)  appends k, v to the window, waits for layer l's transfers, and `attend`s over window +
                      slots + the persistent heads' top-k rows, each where it lies (clo/store.py)
Without speculation (and at the first sparse layer) `refresh` does select + move inside decode.
"""

from __future__ import annotations

import torch

from clo.accounting import count_step, memory_parts, step_device_bytes
from clo.config import CLOConfig
from clo.plan import CLOPlan, estimate_parts, k_select, make_plan
from clo.prefill import staged_kv
from clo.store import LayerStore, Selection, store_order
from kvoffload.kernels.decode_attention import SplitAttention
from kvoffload.kernels.head_cache import lookup_and_update
from kvoffload.kv.interface import KVOffloadSystem, KVSpec
from kvoffload.offload.host import Offload, host_stores, host_stores_pinned, layer_store
from kvoffload.offload.layers import DenseLayers
from kvoffload.offload.link import link_pacer
from kvoffload.offload.retrieval import make_retriever
from kvoffload.offload.transfer import TransferEngine, to_device


class CLO(KVOffloadSystem):
    name = "clo"
    kv_dtypes = ("model", "fp8")
    hit_unit = "one (sequence, layer, KV head) of the reuse heads: its whole top-k; prefetch heads are refreshes"
    settings_class = CLOConfig  # what __init__'s settings are (the runner checks their types against it)

    def __init__(self, **settings) -> None:
        super().__init__()
        self.cfg = CLOConfig.from_settings(settings)  # every setting checked now, before any long work
        self.wants_speculative_query = self.cfg.speculative
        self.supports_cuda_graph = self.cfg.transfer == "uva"  # the CPU-gather path syncs with the host by design
        self.plan: CLOPlan | None = None
        self._planned_for: KVSpec | None = None

    # ---- plan and memory ------------------------------------------------------------------------------------
    def plan_for(self, spec: KVSpec) -> CLOPlan:
        """The plan for these shapes and measurements, made once (the estimate and the allocation share it)."""
        if self._planned_for != spec:  # a frozen dataclass: equal specs plan alike
            self.plan, self._planned_for = make_plan(self.cfg, spec), spec
        return self.plan

    def estimate_parts(self, spec: KVSpec) -> dict[str, int]:
        return estimate_parts(self.cfg, self.plan_for(spec), spec)

    def pinned_host_bytes(self, spec: KVSpec) -> int:
        logical, pinned = host_stores_pinned(spec, self.cfg.dense_layers, spec.prompt_tokens)
        return self.estimate_memory(spec).host_bytes - logical + pinned

    def memory_parts(self) -> dict[str, int]:
        """Device bytes by part (paper Table 6) and the host store, from the real buffers."""
        return memory_parts(self.stores, self.retriever.metadata_bytes(), self.dense.nbytes())

    def _allocate(self, spec: KVSpec) -> None:
        self.plan_for(spec)
        cfg, cuda = self.cfg, spec.device.type == "cuda"
        pacer = link_pacer(spec)  # hardware.link_gb_s: every transfer at the cap; None: the real link
        self.transfer = TransferEngine(cfg.transfer, cfg.cpu_threads, spec.device, cfg.uva_programs, pacer)
        self.retriever = make_retriever(
            cfg.retriever,
            spec.num_layers,
            spec.num_kv_heads,
            spec.head_dim,
            spec.device,
            cfg.rbit,
            cfg.seed,
            cfg.hash_weights,
        )
        self.dense = DenseLayers(spec, cfg.dense_layers)
        self.stores: list[LayerStore | None] = [None] * spec.num_layers
        self.trace: list[tuple[int, torch.Tensor]] | None = None  # (layer, miss mask) when tracing
        self.scored_rows: int | None = None  # end_step's count, for step_device_bytes
        # one layer ahead: lookups and retrieval on `side`, the gathers on `copy`, so that the link moves one
        # layer's rows while the side stream already selects the next layer's
        self.side = torch.cuda.Stream(spec.device) if cuda and self.wants_speculative_query else None
        self.copy = torch.cuda.Stream(spec.device) if self.side is not None else None
        # the cached heads' attention runs here while the compute stream selects the persistent heads' rows: on the
        # layer's critical path, so at the highest priority (-100 is clamped to it), as the runner's decode step
        self.attn_stream = torch.cuda.Stream(spec.device, priority=-100) if cuda else None
        self.ready = [torch.cuda.Event() if self.side is not None else None for _ in range(spec.num_layers)]
        self.pending = [False] * spec.num_layers
        self.side_inputs: list[tuple | None] = [None] * spec.num_layers
        self.persist_sel: list[torch.Tensor | None] = [None] * spec.num_layers  # persist_query=speculative's
        # a step's window row and attended length, set once per step by begin_step (outside any graph) rather
        # than computed from the position in every layer: tiny kernels on the critical path otherwise
        self.win_at = torch.zeros(1, dtype=torch.long, device=spec.device)
        self.win_len = torch.zeros(spec.batch, dtype=torch.long, device=spec.device)
        self.offload = Offload(spec.device, pacer)  # prefill's host copies and hash encoding
        self.hosts = host_stores(spec, cfg.dense_layers, spec.prompt_len)  # handed to the stores at prefill

    # ---- prefill -------------------------------------------------------------------------------------------
    def prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The layer's prompt K/V into its store: staged in the store's head order on the device, then copied to
        host memory and its keys hash-encoded by `offload` (on CUDA while the next layer computes)."""
        self.offload.finish()  # the last layer's staged K/V go before this layer's are made
        spec, cfg, heads = self.spec, self.cfg, self.plan.heads
        if layer in self.dense:
            self.dense.prefill(layer, torch.stack([k, v], dim=3))
            return
        g, persistent = spec.group_size, heads.persistent[layer]
        order = store_order(spec.num_kv_heads, persistent)
        kv = staged_kv(k, v, order)
        k_sel = k_select(cfg, kv.shape[2])
        host = layer_store(self.hosts, layer, spec, cfg.dense_layers, kv.shape[2])
        self.hosts[layer] = None  # the store holds it from here
        store = LayerStore(kv, spec, cfg.sink, cfg.recent, k_sel, persistent, heads.prefetch[layer], g, host, cfg.topk)
        cached = order[: store.nc]
        store.tau = to_device(self.plan.tau[layer, cached], spec.device)
        store.weights = to_device(self.plan.importance[layer, cached].repeat_interleave(g).view(-1, g), spec.device)
        keys = kv[:, :, store.sink : store.sink + store.n_mid, 0]  # a view: a retriever copies what it keeps
        self.offload.start(kv, store.host, lambda: self.retriever.index(layer, keys))
        self.stores[layer] = store

    def end_prefill(self, prompt_len: int) -> None:
        self.offload.finish()  # decode reads the codes and the host store (the CPU-gather path from the host)
        super().end_prefill(prompt_len)

    # ---- decode --------------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        super().begin_step()
        self.dense.begin_step(self.length)
        st = next((s for s in self.stores if s is not None), None)  # every store has the same prompt split
        if st is not None:
            at = st.window_slot(self.length)
            self.win_at.fill_(at)
            self.win_len.fill_(at + 1)

    def prepare(self, layer: int, q_spec: torch.Tensor) -> None:
        """One layer ahead (see `ahead`); without CUDA streams, `refresh` now."""
        if self.stores[layer] is None:
            return
        if self.side is None:
            self.persist_sel[layer] = self.refresh(layer, self.stores[layer].permute_q(q_spec)).persist_idx
            return
        selected = self.ahead(layer, q_spec)
        self.pending[layer] = True
        self.persist_sel[layer] = selected.persist_idx
        # q_spec was allocated on the compute stream and is read on the side stream, the selection on the side
        # stream and read on the copy stream: freed now, their memory could be handed to their stream's next
        # kernel while the other stream still reads it (the lookups then see another tensor's bytes). Held
        # until decode has joined the copy stream.
        self.side_inputs[layer] = (q_spec, selected)

    def ahead(self, layer: int, q_spec: torch.Tensor) -> Selection:
        """`select` on the side stream, behind the compute stream's work so far, and `move` on the copy stream
        behind it; ready[layer] marks the end. Both overlap the current layer's attention and MLP. Returns the
        selection (its memory is the side stream's)."""
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side), self.timer.paused():
            selected = self.select(layer, self.stores[layer].permute_q(q_spec))
        self.copy.wait_stream(self.side)
        with torch.cuda.stream(self.copy), self.timer.paused():
            self.move(layer, selected)
            self.ready[layer].record(self.copy)
        return selected

    def refresh(self, layer: int, qp: torch.Tensor) -> Selection:
        """`select` then `move`, on the current stream (qp in the store's head order)."""
        selected = self.select(layer, qp)
        self.move(layer, selected)
        return selected

    def select(self, layer: int, qp: torch.Tensor) -> Selection:
        """Lookup of the cached heads with qp (labels updated), then the missed heads' top-k for qp; with
        persist_query=speculative also the persistent heads' top-k, scored and selected in the same launches."""
        st = self.stores[layer]
        with_persist = self.cfg.persist_query == "speculative" and st.persist is not None
        if not st.k or not (st.nc or with_persist):
            return Selection()
        miss = None
        if st.nc:
            qc = qp.view(qp.shape[0], -1, st.group, qp.shape[-1])[:, : st.nc]
            with self.phase("cache_mgmt"):
                miss = lookup_and_update(
                    qc, st.labels, st.valid, st.tau, st.weights, st.prefetch_mask, self.cfg.gqa_aggregation
                )
        with self.phase("retrieval"):
            idx = st.retrieve(self.retriever, layer, qp, st.every_head if with_persist else st.cached, miss)
        return Selection(miss, idx[:, : st.nc], idx[:, st.nc :] if with_persist else None)

    def move(self, layer: int, selected: Selection) -> None:
        """The missed heads' rows into their slots, and the bookkeeping of what moved (in the gather kernel)."""
        if selected.miss is None:
            return
        st = self.stores[layer]
        with self.phase("transfer_exposed"):
            self.transfer.fill(
                st.host, st.cached, selected.idx, selected.miss, st.slots, record=(st.slot_idx, st.misses)
            )
        if self.trace is not None:
            self.trace.append((layer, selected.miss.clone()))  # per cached head, in the store's order

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if layer in self.dense:
            with self.phase("attention"):
                return self.dense.decode(layer, q, k, v, self.position)
        st = self.stores[layer]
        st.append(k, v, self.win_at)
        if self.pending[layer]:
            with self.phase("transfer_exposed"):  # the stall behind the copy stream is all that is exposed
                torch.cuda.current_stream().wait_event(self.ready[layer])
            self.pending[layer] = False
            self.side_inputs[layer] = None  # later reuse of their memory is ordered after the copy stream
        elif not self.wants_speculative_query or layer == 0:
            self.persist_sel[layer] = self.refresh(layer, st.permute_q(q)).persist_idx
        persist_idx, self.persist_sel[layer] = self.persist_sel[layer], None
        return self.attend(layer, q, persist_idx)

    def attend(self, layer: int, q: torch.Tensor, persist_idx: torch.Tensor | None) -> torch.Tensor:
        """Hybrid attention over every head (q and the output in the model's head order), the persistent heads at
        persist_idx, or at their top-k for the real query when it is None. On CUDA with both kinds of heads, the
        other heads' attention runs on attn_stream while that top-k is selected: a chain of small kernels that
        leaves most of the GPU idle."""
        st = self.stores[layer]
        if persist_idx is not None or self.attn_stream is None or st.persist is None or not st.nc or not st.k:
            if persist_idx is None and st.persist is not None:
                with self.phase("retrieval"):
                    persist_idx = st.select_persistent(st.permute_q(q), self.retriever, layer)
            if self.selections is not None and st.k:
                self.note_selection(layer, st.attended(persist_idx))
            with self.phase("attention"):
                return st.attend(q, self.win_len, persist_idx)
        compute = torch.cuda.current_stream()
        with self.phase("attention"):
            window, slots, scales = st.buffers(self.win_len)
            scales = None if scales is None else (*scales, None)
            parts = SplitAttention(
                q, *window, slots, indexed_heads=st.persist.shape[1], q_heads=st.order, second_scales=scales
            )
            self.attn_stream.wait_stream(compute)
            with torch.cuda.stream(self.attn_stream):
                parts.split(0, st.nc)
        with self.phase("retrieval"):
            persist_idx = st.select_persistent(st.permute_q(q), self.retriever, layer)
        if self.selections is not None:
            self.note_selection(layer, st.attended(persist_idx))
        with self.phase("attention"):
            parts.split(st.nc, parts.hkv, st.persist_rows(persist_idx))
            compute.wait_stream(self.attn_stream)  # the buffers and q are freed on this stream, after the join
            return parts.merge()[0]

    def end_step(self):
        stats = super().end_step()
        counts = count_step(self.stores, self.spec.host_row_bytes)  # the link moves host rows
        stats.lookups, stats.hits, stats.bytes_h2d, self.scored_rows, stats.refreshes = counts
        stats.host_syncs, self.transfer.host_syncs = self.transfer.host_syncs, 0
        return stats

    def step_device_bytes(self) -> int:
        """CLO's own floor on the device side (clo/accounting.py)."""
        meta = self.retriever.metadata_bytes()
        return step_device_bytes(
            self.stores, meta, self.scored_rows, self.length, self.spec.row_bytes, self.spec.host_row_bytes
        ) + self.dense.step_bytes(self.length)

    def describe(self) -> dict:
        return {
            **self.plan.describe(),
            "retriever": getattr(self.retriever, "weights_source", "exact top-k oracle"),
            "memory_parts": self.memory_parts(),
        }
