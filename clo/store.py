"""Where one sparse layer's K/V lives under CLO, and the tensors that describe it (see clo/system.py).

Inside a store the KV heads are permuted so that the cached heads come first and the persistent heads last:
attention then reads the window of every head, the slots of the cached heads and the persistent heads' full KV
at their top-k indices, each where it lies, with no gather into one buffer. Every index that
changes from step to step comes from the device (the token position), so a step can be replayed from a CUDA
graph."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvoffload.kernels.append_kv import append_kv
from kvoffload.kernels.decode_attention import hybrid_attention
from kvoffload.kv.interface import KVSpec
from kvoffload.offload.budget import split_prompt
from kvoffload.offload.layers import prompt_window, window_positions
from kvoffload.offload.retrieval import select_topk, topk_work
from kvoffload.offload.transfer import to_device


@dataclass
class Selection:
    """One layer's choice for a step, in the store's head order. miss [B, nc]: which cached heads' lookups missed
    (None: no cached heads); idx [B, nc, k]: the missed heads' new top-k (a hit head's rows are unset on CUDA);
    persist_idx [B, Hp, k]: the persistent heads' top-k, with persist_query=speculative only."""

    miss: torch.Tensor | None = None
    idx: torch.Tensor | None = None
    persist_idx: torch.Tensor | None = None


def store_order(num_kv_heads: int, persistent: list[int]) -> list[int]:
    """The store's head order: the cached heads, then the persistent ones (model head ids)."""
    return sorted(set(range(num_kv_heads)) - set(persistent)) + sorted(persistent)


class LayerStore:
    def __init__(
        self,
        kv: torch.Tensor,
        spec: KVSpec,
        sink: int,
        recent: int,
        k: int,
        persistent: list[int],
        prefetch: list[int],
        group: int,
        host: torch.Tensor,
        topk: str = "radix",
    ):
        """kv [B, Hkv, T0, 2, D]: the prompt's K/V, its heads already in store_order (clo.prefill.staged_kv). host:
        the buffer of kv's shape its host copy goes to (kvoffload.offload.host.layer_store); making that copy is the
        caller's (kvoffload.offload.host.Offload), so is setting tau and weights. Nothing here waits for the device."""
        b, hkv, t0, _, d = kv.shape
        dev = spec.device
        self.t0, self.k, self.group = t0, k, group
        self.topk = topk  # select_topk's method
        self.sink, self.recent, self.n_mid = split_prompt(t0, sink, recent)
        order = store_order(hkv, persistent)
        cached = order[: hkv - len(persistent)]
        self.nc = len(cached)
        self.order = to_device(order, dev, torch.long)
        self.cached = torch.arange(self.nc, device=dev)  # head ids in the permuted order
        self.persistent = torch.arange(self.nc, hkv, device=dev)
        self.every_head = torch.arange(hkv, device=dev)
        self.host = host
        self.window = prompt_window(kv[..., 0, :], kv[..., 1, :], self.sink, self.recent, spec.max_len)
        self.prefetch_mask = to_device([h in prefetch for h in cached], dev, torch.bool)
        self.n_managed = sum(h not in prefetch for h in cached)  # cached heads the lookups decide (not prefetch)
        # the transfer engine writes here: host rows as the host store holds them (packed FP8 under kv_dtype=fp8,
        # dequantised only inside attention)
        self.fp8 = spec.fp8
        self.slots = torch.zeros(b, self.nc, k, 2, spec.host_width, dtype=spec.host_dtype, device=dev)
        self.slots_len = torch.full((b,), k, device=dev)
        self.slot_idx = torch.zeros(b, self.nc, k, dtype=torch.long, device=dev)
        self.labels = torch.zeros(b, self.nc, group, d, dtype=torch.float32, device=dev)
        self.valid = torch.zeros(b, self.nc, dtype=torch.bool, device=dev)
        # per cached head, its misses this step (CLO.end_step reads and zeroes them)
        self.misses = torch.zeros(b, self.nc, dtype=torch.int32, device=dev)
        # a copy, never a view: at batch 1 the slice is contiguous, and .contiguous() would keep all of kv alive
        self.persist = kv[:, self.nc :].clone(memory_format=torch.contiguous_format) if persistent else None
        self.tau = self.weights = None  # set by the system, in cached order

    def permute_q(self, q: torch.Tensor) -> torch.Tensor:
        b, h, d = q.shape
        return q.view(b, -1, self.group, d)[:, self.order].reshape(b, h, d)

    def window_slot(self, length: int) -> int:
        """Where in the window the token at position `length` goes (sink and recent rows come first)."""
        return length - self.t0 + self.sink + self.recent

    def append(self, k: torch.Tensor, v: torch.Tensor, at: torch.Tensor) -> None:
        """k, v [B, Hkv, D] (model head order); at: [1] device index of their window row (window_slot)."""
        append_kv(k, v, self.window, self.order, at)

    def retrieve(
        self, retriever, layer: int, qp: torch.Tensor, heads: torch.Tensor, miss: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Absolute token indices [B, h, k] of the top-k middle tokens of `heads` (permuted order) for qp, in no
        order (attention and the gathers do not need one). miss [B, nc], the lookup's: on CUDA the cached heads
        that hit are neither scored nor selected (their rows are unset: only missed heads' indices are read)."""
        work = topk_work(self.topk, qp.shape[0] * heads.shape[0], qp.device)
        scores = retriever.scores(layer, qp, heads, miss, hist=work)
        return select_topk(scores, self.k, self.sink, ascending=False, method=self.topk, miss=miss, work=work)

    def select_persistent(self, qp: torch.Tensor, retriever, layer: int) -> torch.Tensor | None:
        """Token indices [B, Hp, k] of the persistent heads' top-k middle tokens for the real query (None without
        persistent heads): attention reads their rows in `persist` through them."""
        if self.persist is None or not self.k:
            return None
        return self.retrieve(retriever, layer, qp, self.persistent)

    def attend(self, q: torch.Tensor, win_len: torch.Tensor, persist_idx: torch.Tensor | None) -> torch.Tensor:
        """Hybrid attention (docs/systems.md, "Hybrid attention") over the window (sink, recent, generated: win_len [B]
        rows, on the device), the slots and the persistent heads' KV at persist_idx (select_persistent's), each where it
        lies. q and the result are in the model's head order (the kernel maps the store's heads to it: no permuted
        copies)."""
        window, slots, scales = self.buffers(win_len)
        persist = self.persist_rows(persist_idx)
        return hybrid_attention(q, window, slots, persist, q_heads=self.order, second_scales=scales)

    def buffers(self, win_len: torch.Tensor):
        """(window, slots, scales) as decode attention reads them: (k, v, lengths), k and v [B, T, heads, D] views;
        scales None, or under kv_dtype=fp8 (ks, vs) [B, k, nc] views of the slots' scales, the slots' k and v then
        their e4m3 bits (hybrid_attention's second_scales)."""
        window = (self.window[:, :, :, 0].transpose(1, 2), self.window[:, :, :, 1].transpose(1, 2), win_len)
        d = self.window.shape[-1]
        k2, v2 = (self.slots[:, :, :, j, :d].transpose(1, 2) for j in (0, 1))
        scales = None
        if self.fp8:
            scales = tuple(self.slots[:, :, :, j, d:].view(torch.float16)[..., 0].transpose(1, 2) for j in (0, 1))
        return window, (k2, v2, self.slots_len), scales

    def persist_rows(self, persist_idx: torch.Tensor | None):
        """The persistent heads' rows at persist_idx, as hybrid attention's `indexed` (None without them)."""
        if persist_idx is None:
            return None
        return self.persist[:, :, :, 0].transpose(1, 2), self.persist[:, :, :, 1].transpose(1, 2), persist_idx

    def attended(self, persist_idx: torch.Tensor | None) -> torch.Tensor:
        """The prompt positions [B, Hkv, n] the layer attends, in the model's head order: sink, recent, and each
        cached head's slots (their positions, as the gathers recorded them) or each persistent head's top-k."""
        b = self.slot_idx.shape[0]
        rows = self.slot_idx if persist_idx is None else torch.cat([self.slot_idx, persist_idx], dim=1)
        window = window_positions(self.t0, self.sink, self.recent, rows.device)
        rows = torch.cat([window.expand(b, rows.shape[1], -1), rows], dim=2)
        out = torch.empty_like(rows)
        out[:, self.order] = rows  # store order -> model order
        return out

    def memory(self) -> dict[str, int]:
        persist = self.persist.nbytes if self.persist is not None else 0
        return {
            "slots": self.slots.nbytes + self.slot_idx.nbytes,
            "labels": self.labels.nbytes + self.valid.nbytes,
            "persistent": persist,
            "window": self.window.nbytes,
            "host": self.host.nbytes,
        }
