"""flashinfer's batch decode (BatchDecodeWithPagedKVCacheWrapper) over a token-major KV cache, as serving engines
run it: the cache [B, T, Hkv, D] of a layer is read as pages of PAGE tokens ([B * T / PAGE, PAGE, Hkv, D], NHD),
sequence b owning pages b * T / PAGE onwards, so no copy is made. One plan per decode step serves every layer
(all layers share the lengths); with `graph` the wrapper keeps its page table in fixed device buffers, so the
step that runs it can be captured in a CUDA graph once and replayed after each step's plan (vLLM's and SGLang's
use: plan on the host, then replay).

A plan writes its schedule into a page-locked host buffer and copies it to the device asynchronously; a host that
runs steps ahead of the device (nothing syncs between our steps) would overwrite that buffer before the last copy
has read it. Each plan therefore waits for the previous plan's copy (an event recorded after it), which completes
when the device reaches the previous step: the host still plans one step ahead, and no step waits for the host."""

from __future__ import annotations

import math

import torch

PAGE = 16  # tokens per page: flashinfer's usual size; the cache's token axis is padded to a multiple of it
WORKSPACE_BYTES = 128 * 1024 * 1024  # flashinfer's recommended float workspace (split-kv partial results)


def flashinfer_module():
    try:
        import flashinfer  # optional GPU extra

        return flashinfer
    except ImportError:
        return None


def padded_len(max_len: int) -> int:
    return math.ceil(max_len / PAGE) * PAGE


class PagedDecode:
    def __init__(
        self,
        batch: int,
        max_len: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        graph: bool,
        tensor_cores: bool = False,
    ) -> None:
        fi = flashinfer_module()
        assert fi is not None, "PagedDecode needs flashinfer"
        self.batch, self.heads, self.kv_heads, self.head_dim, self.dtype = (
            batch,
            num_heads,
            num_kv_heads,
            head_dim,
            dtype,
        )
        self.pages_per_seq = padded_len(max_len) // PAGE
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # every sequence's pages in order; a step's page list is the first n of each row, flattened
        self.all_pages = torch.arange(batch * self.pages_per_seq, dtype=torch.int32, device=device).view(batch, -1)
        buffers = {}
        if graph:
            buffers = dict(
                paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device=device),
                paged_kv_indices_buffer=torch.zeros(batch * self.pages_per_seq, dtype=torch.int32, device=device),
                paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32, device=device),
            )
        self.wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=graph, use_tensor_cores=tensor_cores, **buffers
        )
        self.n_pages = -1
        self.indices: torch.Tensor | None = None
        self.planned: torch.cuda.Event | None = None

    def plan(self, length: int) -> None:
        """Every sequence attends its first `length` tokens (the step's new one included)."""
        n = math.ceil(length / PAGE)
        if n != self.n_pages:
            self.n_pages = n
            self.indices = self.all_pages[:, :n].flatten()
        indptr = torch.arange(self.batch + 1, dtype=torch.int32) * n
        last = torch.full((self.batch,), length - (n - 1) * PAGE, dtype=torch.int32)
        if self.planned is not None:
            self.planned.synchronize()  # the previous plan's host buffer has been read (see the module's note)
        self.wrapper.plan(
            indptr,
            self.indices,
            last,
            self.heads,
            self.kv_heads,
            self.head_dim,
            PAGE,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )
        self.planned = torch.cuda.Event()
        self.planned.record()

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, H, D]; k, v [B, T_padded, Hkv, D] one layer's cache -> [B, H, D]."""
        pages = lambda x: x.view(-1, PAGE, self.kv_heads, self.head_dim)  # noqa: E731
        return self.wrapper.run(q, (pages(k), pages(v)))
