"""CLO (spec 2): a head-wise approximate GPU cache keyed on query similarity, importance-aware thresholds,
persistent heads + one-layer-ahead speculative prefetch, and a transfer path with no CPU gather.

Where each token's K/V lives, per layer at or above `dense_layers` (below it: dense attention, full KV on
the device):
  host    the whole prompt, head-major [B, Hkv, T0, 2, D] (pinned on CUDA)
  window  sink + recent prompt tokens, and every generated token (device)
  slots   per cached KV head, the top-k middle rows selected for its query label (device)
  persist the full prompt KV of the layer's persistent heads (device)
A decode step attends, per KV head, over window + (slots, or top-k of its persistent KV), reading each buffer
where it lies (clo/store.py).
"""
from __future__ import annotations

import torch

from kvoffload.errors import ConfigError
from kvoffload.kernels.decode_attention import decode_attention
from kvoffload.kernels.head_cache import lookup_and_update
from kvoffload.kv.interface import KVOffloadSystem, KVSpec, MemoryEstimate, split_host
from clo.store import LayerStore
from kvoffload.offload.budget import check_budget, select_budget, split_prompt
from clo.policy.persistent import HeadPlan, heads_per_layer_time, load_profile, plan_persistent_heads
from clo.policy.thresholds import load_importance, thresholds
from kvoffload.kernels.head_cache import AGGREGATIONS
from kvoffload.offload.retrieval import RETRIEVERS, check_topk_method, make_retriever, metadata_bytes_per_token
from kvoffload.offload.transfer import TransferEngine

# which query selects a persistent head's top-k rows: the layer's real query, on the critical path (spec 2.3:
# persistent heads "run top-k there"), or the speculative one, one layer ahead with the other heads' selection
# (as the prefetch heads select theirs); attention always uses the real query
PERSIST_QUERIES = ("real", "speculative")


class CLO(KVOffloadSystem):
    name = "clo"

    def __init__(self, topk_ratio: float = 0.1, sink: int = 16, recent: int = 64, dense_layers: int = 2,
                 retriever: str = "hash", rbit: int = 256, seed: int = 0, eta: float = 0.8, n: float = 3.0,
                 adaptive_threshold: bool = True, gqa_aggregation: str = "mean",
                 threshold_override: float | None = None, importance: str = "uniform", profile: str = "none",
                 epsilon: float = 0.1, persistent: bool = True, speculative: bool = True,
                 layer_time_ms: float | None = None, link_gb_s: float | None = None, transfer: str = "uva",
                 cpu_threads: int = 4, uva_programs: int | None = 32, topk: str = "radix",
                 persist_query: str = "real") -> None:
        super().__init__()
        check_budget(topk_ratio, sink, recent, dense_layers)
        if not -1.0 < eta <= 1.0:
            raise ConfigError(f"eta={eta} must lie in (-1, 1]")
        if gqa_aggregation not in AGGREGATIONS:
            raise ConfigError(f"gqa_aggregation={gqa_aggregation!r}; valid: {', '.join(AGGREGATIONS)}")
        if retriever not in RETRIEVERS:
            raise ConfigError(f"retriever={retriever!r}; valid: {', '.join(RETRIEVERS)}")
        check_topk_method(topk)
        if persist_query not in PERSIST_QUERIES:
            raise ConfigError(f"persist_query={persist_query!r}; valid: {', '.join(PERSIST_QUERIES)}")
        if persist_query == "speculative" and persistent and not speculative:
            raise ConfigError("persist_query=speculative selects one layer ahead: it needs speculative=true")
        self.cfg = dict(topk_ratio=topk_ratio, sink=sink, recent=recent, dense_layers=dense_layers,
                        retriever=retriever, rbit=rbit, seed=seed, eta=eta, n=n,
                        adaptive_threshold=adaptive_threshold, gqa_aggregation=gqa_aggregation,
                        threshold_override=threshold_override, importance=importance, profile=profile,
                        epsilon=epsilon, persistent=persistent, speculative=speculative,
                        layer_time_ms=layer_time_ms, link_gb_s=link_gb_s, transfer=transfer,
                        cpu_threads=cpu_threads, uva_programs=uva_programs, topk=topk, persist_query=persist_query)
        self.wants_speculative_query = speculative
        self.supports_cuda_graph = transfer == "uva"  # the CPU-gather path syncs with the host by design
        self.transfer_kind, self.cpu_threads, self.uva_programs = transfer, cpu_threads, uva_programs
        TransferEngine(transfer, cpu_threads, torch.device("cpu"), uva_programs)  # validates before any long work

    # ---- planning ------------------------------------------------------------------------------------------
    def _policy(self, spec: KVSpec) -> None:
        c, L, hkv = self.cfg, spec.num_layers, spec.num_kv_heads
        if c["dense_layers"] > L:
            raise ConfigError(f"dense_layers={c['dense_layers']} exceeds the model's {L} layers")
        importance, self.importance_source = load_importance(c["importance"], L, hkv)
        tau = thresholds(importance, c["eta"], c["n"]) if c["adaptive_threshold"] else torch.full((L, hkv), c["eta"])
        if c["threshold_override"] is not None:
            tau = torch.full((L, hkv), float(c["threshold_override"]))
        self.tau, self.importance = tau, importance
        s_hat, self.profile_source = load_profile(c["profile"], L, hkv)
        self.link_bytes_per_s = self._link_bandwidth(spec)
        layer_s = (c["layer_time_ms"] / 1e3 if c["layer_time_ms"] is not None else spec.layer_time_s) or 1e-4
        self.layer_time_s = layer_s
        k_max = self._k_select(spec.max_len)
        n_p = heads_per_layer_time(layer_s, self.link_bytes_per_s, spec.batch * k_max * self._row_bytes(spec))
        if c["persistent"]:
            self.plan = plan_persistent_heads(tau, s_hat, c["epsilon"], n_p, skip_layers=c["dense_layers"])
        else:
            self.plan = HeadPlan([[] for _ in range(L)], [[] for _ in range(L)], n_p)

    def _link_bandwidth(self, spec: KVSpec) -> float:
        return self.cfg["link_gb_s"] * 1e9 if self.cfg["link_gb_s"] is not None else spec.link_bytes_per_s

    @staticmethod
    def _row_bytes(spec: KVSpec) -> int:
        return 2 * spec.head_dim * spec.dtype_bytes

    def _k_select(self, prompt_len: int) -> int:
        return select_budget(prompt_len, self.cfg["topk_ratio"], self.cfg["sink"], self.cfg["recent"])

    def estimate_memory(self, spec: KVSpec) -> MemoryEstimate:
        """memory_parts() from the shapes alone, for the spec's prompt length (max_len when it is not given), with
        the persistent heads as planned."""
        return split_host(self.estimate_parts(spec))

    def estimate_parts(self, spec: KVSpec) -> dict[str, int]:
        if not hasattr(self, "plan"):
            self._policy(spec)
        c, row, t0, b, hkv = self.cfg, self._row_bytes(spec), spec.prompt_tokens, spec.batch, spec.num_kv_heads
        sink, recent, n_mid = split_prompt(t0, c["sink"], c["recent"])
        k, g = self._k_select(t0), spec.group_size
        meta_per_token = metadata_bytes_per_token(c["retriever"], c["rbit"], spec.head_dim, spec.dtype_bytes)
        dense = min(c["dense_layers"], spec.num_layers)
        parts = {"slots": 0, "labels": 0, "persistent": 0, "window": 0, "metadata": 0,
                 "dense_layers": b * dense * hkv * spec.max_len * row, "host": 0}
        for layer in range(dense, spec.num_layers):
            nc = hkv - len(self.plan.persistent[layer])
            parts["slots"] += b * nc * k * (row + 8)  # rows + their token indices
            parts["labels"] += b * nc * (g * spec.head_dim * 4 + 1)  # fp32 labels + valid flag
            parts["persistent"] += b * (hkv - nc) * t0 * row
            parts["window"] += b * hkv * (sink + recent + spec.max_len - t0) * row
            parts["metadata"] += b * hkv * n_mid * meta_per_token
            parts["host"] += b * hkv * t0 * row
        return parts

    def _allocate(self, spec: KVSpec) -> None:
        self._policy(spec)  # again: the spec now carries the measured layer time
        self.transfer = TransferEngine(self.transfer_kind, self.cpu_threads, spec.device, self.uva_programs)
        self.retriever = make_retriever(self.cfg["retriever"], spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                        spec.device, self.cfg["rbit"], self.cfg["seed"])
        self.stores: list[LayerStore | None] = [None] * spec.num_layers
        self.dense_kv: list[torch.Tensor | None] = [None] * spec.num_layers
        self.trace: list[tuple[int, torch.Tensor]] | None = None  # (layer, miss mask) when tracing
        self.scored_rows: int | None = None  # end_step's count, for step_device_bytes
        cuda = spec.device.type == "cuda"
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
        # a step's window row and attended lengths, set once per step by begin_step (outside any graph) rather
        # than computed from the position in every layer: tiny kernels on the critical path otherwise
        self.win_at = torch.zeros(1, dtype=torch.long, device=spec.device)
        self.win_len = torch.zeros(spec.batch, dtype=torch.long, device=spec.device)
        self.dense_len = torch.zeros(spec.batch, dtype=torch.long, device=spec.device)

    # ---- prefill -------------------------------------------------------------------------------------------
    def prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        spec = self.spec
        kv = torch.stack([k, v], dim=3)  # [B, Hkv, T0, 2, D]
        t0 = kv.shape[2]
        if layer < self.cfg["dense_layers"]:
            buf = torch.empty(spec.batch, spec.num_kv_heads, spec.max_len, 2, spec.head_dim, dtype=spec.dtype,
                              device=spec.device)
            buf[:, :, :t0] = kv
            self.dense_kv[layer] = buf
            return
        g = spec.group_size
        store = LayerStore(kv, spec, self.cfg["sink"], self.cfg["recent"], self._k_select(t0),
                           self.plan.persistent[layer], self.plan.prefetch[layer], g, self.cfg["topk"])
        cached_ids = store.order[: store.nc].cpu()
        store.tau = self.tau[layer, cached_ids].to(spec.device)
        store.weights = self.importance[layer, cached_ids].repeat_interleave(g).view(-1, g).to(spec.device)
        self.retriever.index(layer, k[:, store.order, store.sink: store.sink + store.n_mid])
        self.stores[layer] = store

    # ---- decode --------------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        super().begin_step()
        self.dense_len.fill_(self.length + 1)
        st = next((s for s in self.stores if s is not None), None)  # every store has the same prompt split
        if st is not None:
            at = st.window_slot(self.length)
            self.win_at.fill_(at)
            self.win_len.fill_(at + 1)

    def prepare(self, layer: int, q_spec: torch.Tensor) -> None:
        """One layer ahead: lookup and retrieval for `layer` start on the side stream, behind the speculative
        query, and its transfers on the copy stream behind them; both overlap the current layer's attention and
        MLP, and the copy stream's transfers overlap the side stream's work for the next layer."""
        if self.stores[layer] is None:
            return
        if self.side is None:
            self.persist_sel[layer] = self._refresh(layer, self.stores[layer].permute_q(q_spec))
            return
        selected = self._ahead(layer, q_spec)
        self.pending[layer] = True
        self.persist_sel[layer] = selected[2]
        # q_spec was allocated on the compute stream and is read on the side stream, the selection on the side
        # stream and read on the copy stream: freed now, their memory could be handed to their stream's next
        # kernel while the other stream still reads it (the lookups then see another tensor's bytes). Held
        # until decode has joined the copy stream.
        self.side_inputs[layer] = (q_spec, selected)

    def _ahead(self, layer: int, q_spec: torch.Tensor) -> tuple:
        """_select on the side stream, behind the compute stream's work so far, and _move on the copy stream
        behind it; ready[layer] marks the end. Returns the selection (its memory is the side stream's)."""
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side), self.timer.paused():
            selected = self._select(layer, self.stores[layer].permute_q(q_spec))
        self.copy.wait_stream(self.side)
        with torch.cuda.stream(self.copy), self.timer.paused():
            self._move(layer, selected)
            self.ready[layer].record(self.copy)
        return selected

    def _refresh(self, layer: int, qp: torch.Tensor) -> torch.Tensor | None:
        """Lookup with qp (permuted head order); for missed heads, new top-k with qp and their rows moved
        into their slots (all on the current stream). Returns _select's persistent selection."""
        selected = self._select(layer, qp)
        self._move(layer, selected)
        return selected[2]

    def _select(self, layer: int, qp: torch.Tensor) -> tuple:
        """(miss [B, nc], idx [B, nc, k], persist_idx [B, Hp, k] or None): which cached heads missed qp (labels
        updated) and the missed heads' top-k for qp (on CUDA a head that hit is not scored: its rows of idx are
        unset, and only missed heads' are read); with persist_query=speculative also the persistent heads' top-k,
        scored and selected in the same launches. (None, None, None) when there is nothing to select; miss is None
        for a store without cached heads."""
        st = self.stores[layer]
        with_persist = self.cfg["persist_query"] == "speculative" and st.persist is not None
        if not st.k or not (st.nc or with_persist):
            return None, None, None
        miss = None
        if st.nc:
            qc = qp.view(qp.shape[0], -1, st.group, qp.shape[-1])[:, : st.nc]
            with self.phase("cache_mgmt"):
                miss = lookup_and_update(qc, st.labels, st.valid, st.tau, st.weights, st.prefetch_mask,
                                         self.cfg["gqa_aggregation"])
        with self.phase("retrieval"):
            idx = st.retrieve(self.retriever, layer, qp, st.every_head if with_persist else st.cached, miss)
        return miss, idx[:, : st.nc], idx[:, st.nc:] if with_persist else None

    def _move(self, layer: int, selected: tuple) -> None:
        """The missed heads' rows into their slots, and the bookkeeping of what moved."""
        if selected[0] is None:
            return
        st, (miss, idx, _) = self.stores[layer], selected
        with self.phase("transfer_exposed"):  # the bookkeeping of what moved in the gather kernel itself
            self.transfer.fill(st.host, st.cached, idx, miss, st.slots, record=(st.slot_idx, st.misses))
        if self.trace is not None:
            self.trace.append((layer, miss.clone()))  # per cached head, in the store's order

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if layer < self.cfg["dense_layers"]:
            buf = self.dense_kv[layer]
            buf.index_copy_(2, self.position, torch.stack([k, v], dim=2)[:, :, None])
            with self.phase("attention"):
                return decode_attention(q, buf[:, :, :, 0].transpose(1, 2), buf[:, :, :, 1].transpose(1, 2),
                                        self.dense_len)
        st = self.stores[layer]
        st.append(k, v, self.win_at)
        if self.pending[layer]:
            with self.phase("transfer_exposed"):  # the stall behind the copy stream is all that is exposed
                torch.cuda.current_stream().wait_event(self.ready[layer])
            self.pending[layer] = False
            self.side_inputs[layer] = None  # later reuse of their memory is ordered after the copy stream
        elif not self.wants_speculative_query or layer == 0:
            self.persist_sel[layer] = self._refresh(layer, st.permute_q(q))
        persist_idx, self.persist_sel[layer] = self.persist_sel[layer], None
        return self._attend(layer, q, persist_idx)

    def _attend(self, layer: int, q: torch.Tensor, persist_idx: torch.Tensor | None) -> torch.Tensor:
        """Hybrid attention over every head (q and the output in the model's head order), the persistent heads at
        persist_idx, or at their top-k for the real query when it is None. On CUDA with both kinds of heads, the
        other heads' attention runs on attn_stream while that top-k is selected: a chain of small kernels that
        leaves most of the GPU idle."""
        st = self.stores[layer]
        if persist_idx is not None or self.attn_stream is None or st.persist is None or not st.nc or not st.k:
            if persist_idx is None and st.persist is not None:
                with self.phase("retrieval"):
                    persist_idx = st.select_persistent(st.permute_q(q), self.retriever, layer)
            with self.phase("attention"):
                return st.attend(q, self.win_len, persist_idx)
        from kvoffload.kernels.decode_attention import SplitAttention

        compute = torch.cuda.current_stream()
        with self.phase("attention"):
            window, slots = st.buffers(self.win_len)
            parts = SplitAttention(q, *window, slots, indexed_heads=st.persist.shape[1], q_heads=st.order)
            self.attn_stream.wait_stream(compute)
            with torch.cuda.stream(self.attn_stream):
                parts.split(0, st.nc)
        with self.phase("retrieval"):
            persist_idx = st.select_persistent(st.permute_q(q), self.retriever, layer)
        with self.phase("attention"):
            parts.split(st.nc, parts.hkv, st.persist_rows(persist_idx))
            compute.wait_stream(self.attn_stream)  # the buffers and q are freed on this stream, after the join
            return parts.merge()[0]

    def end_step(self):
        stats = super().end_step()
        # every store with cached heads is looked up once per step (at prepare, or at decode without prefetch);
        # the prefetch heads are refreshed every step by design and count as transfers, not as lookups
        active = [st for st in self.stores if st is not None and st.nc and st.k]
        managed_misses = refreshes = 0
        if active:  # one host sync for all layers
            counts = torch.stack([torch.stack([(st.misses * ~st.prefetch_mask).sum(), st.misses.sum()]) for st in active])
            managed_misses, refreshes = counts.sum(0).tolist()
        stats.lookups = sum(st.misses.shape[0] * st.n_managed for st in active)
        stats.hits = stats.lookups - managed_misses
        row = self._row_bytes(self.spec)
        stats.bytes_h2d = refreshes * row * max((s.k for s in self.stores if s is not None), default=0)
        # (sequence, head) rows whose metadata the step's retrieval needs: the refreshed cached heads and every
        # persistent head (on CUDA a cached head that hit is not scored)
        self.scored_rows = refreshes + sum(st.window.shape[0] * (st.window.shape[1] - st.nc)
                                           for st in self.stores if st is not None and st.k)
        with torch.inference_mode():  # the buffers were made in (inference-mode) prefill
            for st in active:
                st.misses.zero_()
        stats.host_syncs = self.transfer.host_syncs
        self.transfer.host_syncs = 0
        return stats

    # ---- memory ---------------------------------------------------------------------------------------------
    def memory_parts(self) -> dict[str, int]:
        """Device bytes by part (paper Table 6) and the host store."""
        parts = {"slots": 0, "labels": 0, "persistent": 0, "window": 0, "metadata": self.retriever.metadata_bytes(),
                 "dense_layers": sum(b.nbytes for b in self.dense_kv if b is not None), "host": 0}
        for st in self.stores:
            if st is not None:
                for key, val in st.memory().items():
                    parts[key] += val
        return parts

    def memory_held(self) -> MemoryEstimate:
        return split_host(self.memory_parts())

    def step_device_bytes(self) -> int:
        """Per step: the attended rows (window, selected rows, dense layers), the labels, and the retrieval
        metadata of the rows the last step needed scored (end_step's count; every row before a step has run).
        On CUDA exactly those are read; the CPU reference scores every row."""
        row = self._row_bytes(self.spec)
        rows = sum(st.window.shape[0] * st.window.shape[1] for st in self.stores if st is not None)
        scored = rows if self.scored_rows is None else self.scored_rows
        total = self.retriever.metadata_bytes() * scored // max(rows, 1)
        for st in self.stores:
            if st is not None:
                gen = self.length - st.t0 + 1
                total += row * st.window.shape[0] * st.window.shape[1] * (st.sink + st.recent + gen + st.k)
                total += st.labels.nbytes
        dense = sum(1 for b in self.dense_kv if b is not None)
        return total + dense * row * self.spec.batch * self.spec.num_kv_heads * (self.length + 1)

    def describe(self) -> dict:
        return {"importance": self.importance_source, "profile": self.profile_source,
                "retriever": getattr(self.retriever, "weights_source", "exact top-k oracle"),
                "plan": self.plan.summary(), "layer_time_ms": self.layer_time_s * 1e3,
                "link_gb_s": self.link_bytes_per_s / 1e9, "memory_parts": self.memory_parts()}


