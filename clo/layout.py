"""Where one sparse layer's K/V lives under CLO, and the tensors that describe it (see clo/system.py)."""
from __future__ import annotations

import torch

from clo.kv.interface import KVSpec


def split_prompt(prompt_len: int, sink: int, recent: int) -> tuple[int, int, int]:
    """(sink, recent, middle) token counts: sink and recent are always attended, the middle is retrieved."""
    s = min(sink, prompt_len)
    r = min(recent, prompt_len - s)
    return s, r, prompt_len - s - r


class LayerStore:
    def __init__(self, kv: torch.Tensor, spec: KVSpec, sink: int, recent: int, k: int, persistent: list[int],
                 prefetch: list[int], group: int):
        b, hkv, t0, _, d = kv.shape
        dev, dtype = spec.device, spec.dtype
        self.t0, self.k = t0, k
        self.sink, self.recent, self.n_mid = split_prompt(t0, sink, recent)
        pin = dev.type == "cuda"
        self.host = torch.empty(kv.shape, dtype=dtype, pin_memory=pin)
        self.host.copy_(kv)
        # window = sink rows, recent rows, then every generated token
        self.window = torch.empty(b, hkv, self.sink + self.recent + spec.max_len - t0, 2, d, dtype=dtype, device=dev)
        self.window[:, :, : self.sink] = kv[:, :, : self.sink]
        self.window[:, :, self.sink: self.sink + self.recent] = kv[:, :, t0 - self.recent: t0]
        heads = set(range(hkv))
        self.persistent = torch.tensor(sorted(persistent), dtype=torch.long, device=dev)
        self.cached = torch.tensor(sorted(heads - set(persistent)), dtype=torch.long, device=dev)
        self.prefetch_mask = torch.tensor([h in prefetch for h in self.cached.tolist()], dtype=torch.bool, device=dev)
        nc = len(self.cached)
        self.slots = torch.zeros(b, nc, k, 2, d, dtype=dtype, device=dev)
        self.slot_idx = torch.zeros(b, nc, k, dtype=torch.long, device=dev)
        self.labels = torch.zeros(b, nc, group, d, dtype=torch.float32, device=dev)
        self.valid = torch.zeros(b, nc, dtype=torch.bool, device=dev)
        self.persist = kv[:, self.persistent].contiguous() if persistent else None
        self.tau = self.weights = None  # set by the system

    def append(self, new: torch.Tensor, i: int) -> None:
        """new [B, Hkv, 2, D]: the i-th generated token."""
        self.window[:, :, self.sink + self.recent + i] = new

    def persistent_topk(self, q: torch.Tensor, retriever, layer: int) -> torch.Tensor | None:
        """Top-k of the persistent heads' middle tokens for the real query, read from device memory."""
        if self.persist is None or not self.k:
            return None
        from clo.retrieval import select_topk

        idx = select_topk(retriever.scores(layer, q, self.persistent), self.k, self.sink)
        b = torch.arange(idx.shape[0], device=idx.device)[:, None, None]
        p = torch.arange(len(self.persistent), device=idx.device)[None, :, None]
        return self.persist[b, p, idx]

    def attended(self, n_window_gen: int, persist_rows: torch.Tensor | None) -> torch.Tensor:
        """[B, Hkv, N, 2, D]: window (with n_window_gen generated tokens) then each head's selected rows."""
        win = self.window[:, :, : self.sink + self.recent + n_window_gen]
        if not self.k:
            return win
        sel = torch.empty(win.shape[0], win.shape[1], self.k, *win.shape[3:], dtype=win.dtype, device=win.device)
        sel[:, self.cached] = self.slots
        if persist_rows is not None:
            sel[:, self.persistent] = persist_rows
        return torch.cat([win, sel], dim=2)

    def memory(self) -> dict[str, int]:
        return {"slots": self.slots.nbytes + self.slot_idx.nbytes, "labels": self.labels.nbytes + self.valid.nbytes,
                "persistent": self.persist.nbytes if self.persist is not None else 0,
                "window": self.window.nbytes, "host": self.host.nbytes}
