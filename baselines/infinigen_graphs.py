"""InfiniGen-style's GPU side in per-layer CUDA graphs, around its one host sync a layer (the worker's wait for
the indices, baselines/cpu_fetch.py). The eager path launches about twenty small kernels a layer for the speculation and
concatenates the window with the fetched rows before attending; the launch thread that does so is the one that must also
wake for the fetch, and a trace of the eager step (results/investigations/infinigen_step_8k/) shows the GPU idle while
it launches. InfiniGen's public code is eager PyTorch; capturing the same kernels, as RetroInfer-style's are
(baselines/retroinfer_graphs.py), makes it the strongest honest version of its GPU side without changing what it
computes or moves.

Per sparse layer l and step:
  speculate (graph)  during layer l-1: the partial scores of the speculative query, the top-k, the flat host-row
                     indices copied into the fetcher's pinned index buffer of l's parity
  fetch              the worker waits for that copy, gathers the rows on the CPU and copies them to the device
                     buffer of l's parity, chunk by chunk (PipelinedFetcher)
  attend (graph)     after the compute stream waits for the fetch's last copy: attention over the window (its
                     length from a pinned buffer) and the fetched rows, read where they lie, in the split kernel
                     RetroInfer-style and CLO use
"""

from __future__ import annotations

import torch

from baselines.offloaded import replay_graph
from kvoffload.kernels.decode_attention import hybrid_attention
from kvoffload.offload.retrieval import select_topk


class InfiniGenLayerGraphs:
    """One sparse layer's graphs and static buffers; `system` is the InfiniGen instance (its partial keys, bases,
    window, fetch buffers and fetcher), made at the layer's first decode step, after the prompt is stored."""

    def __init__(self, system, layer: int, pool) -> None:
        spec = system.spec
        self.system, self.layer, self.pool = system, layer, pool
        b, hkv, d, dev = spec.batch, spec.num_kv_heads, spec.head_dim, spec.device
        self.parity = layer % 2
        self.k_sel = system.k_select(system.t0)
        self.q_spec = torch.zeros(b, spec.num_heads, d, dtype=spec.dtype, device=dev)
        self.q = torch.zeros_like(self.q_spec)
        t = system.host[layer].shape[2]
        self.row_base = (torch.arange(b * hkv, device=dev) * t).view(b, hkv, 1)  # each head's rows in the store
        self.win_len = torch.zeros(b, dtype=torch.int32, device=dev)
        self.win_len_host = torch.zeros(b, dtype=torch.int32, pin_memory=True)
        self.n_fetched = torch.full((b,), self.k_sel, dtype=torch.int32, device=dev)
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self.out: torch.Tensor | None = None

    # ---- the captured parts --------------------------------------------------------------------------
    def _speculate(self) -> None:
        s = self.system
        scores = s.partial_scores(self.layer, self.q_spec)
        idx = select_topk(scores, self.k_sel, 0, method=s.topk)  # [B, Hkv, k] positions among the middle tokens
        s.fetcher.idx[self.parity].copy_((idx + self.row_base).view(-1), non_blocking=True)

    def _attend(self) -> None:
        s = self.system
        self.win_len.copy_(self.win_len_host, non_blocking=True)
        win = s.window[self.layer]  # [B, Hkv, W, 2, D]
        rows = s.buffers[self.parity]  # [B, Hkv, k, 2, D] (packed FP8 under kv_dtype=fp8: D + 2 bytes)
        d = self.q.shape[-1]
        scales = None
        if s.spec.fp8:  # the rows' e4m3 bits and scales, read in place and dequantised in the kernel
            scales = tuple(rows[:, :, :, j, d:].view(torch.float16)[..., 0].transpose(1, 2) for j in (0, 1))
        self.out = hybrid_attention(
            self.q,
            (win[:, :, :, 0].transpose(1, 2), win[:, :, :, 1].transpose(1, 2), self.win_len),
            (rows[:, :, :, 0, :d].transpose(1, 2), rows[:, :, :, 1, :d].transpose(1, 2), self.n_fetched),
            second_scales=scales,
        )

    def _replay(self, name: str, fn) -> None:
        replay_graph(self.graphs, name, fn, self.pool)

    # ---- one step -------------------------------------------------------------------------------------
    def speculate(self, q_spec: torch.Tensor) -> None:
        """Layer l's rows selected and their fetch started (during layer l-1)."""
        s = self.system
        with s.phase("retrieval"):
            self.q_spec.copy_(q_spec)
            self._replay("speculate", self._speculate)
        s.start_fetch(self.layer)

    def attend(self, q: torch.Tensor, n_win: int) -> torch.Tensor:
        """Layer l's attention output [B, H, D] once its fetch has landed."""
        s = self.system
        s.wait_fetch(self.layer)  # after it, the layer's last replay (the one reading win_len_host) has run
        self.win_len_host.fill_(n_win)
        with s.phase("attention"):
            self.q.copy_(q)
            self._replay("attend", self._attend)
        return self.out
