"""A block cache's slots and blocks expanded to the rows attention reads, in one launch.

  slots  [R, n] int32   each selected block's slot in its row's cache (R = sequences x KV heads)
  blocks [R, n] int32   each selected block's id: its tokens are block * bs ... block * bs + bs - 1
  ->  rows [R, n * bs] int32   slot * bs + j for the j-th token of each block; -1 where that token lies past
                               n_tokens (a partial last block's padding: never attended)
      flat [R, n] int32        slot + r * cap: the slot in the cache of every row, flattened (what a block copy
                               addresses)

RetroInfer-style's layer graph (baselines/retroinfer_graphs.py) needs both after its LRU's decision is copied to
the device; in torch that arithmetic was some ten small kernels a layer. `block_rows_ref` is the specification.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: the reference is used
    triton = None


def block_rows_ref(
    slots: torch.Tensor, blocks: torch.Tensor, block_size: int, n_tokens: int, cap: int
) -> tuple[torch.Tensor, torch.Tensor]:
    off = torch.arange(block_size, device=slots.device, dtype=torch.int32)
    rows = slots[..., None] * block_size + off
    token = blocks[..., None] * block_size + off
    rows = torch.where(token < n_tokens, rows, -1).flatten(-2).to(torch.int32)
    base = torch.arange(slots.shape[0], device=slots.device, dtype=torch.int32)[:, None] * cap
    return rows, (slots + base).to(torch.int32)


if triton is not None:

    @triton.jit
    def _block_rows_kernel(Slots, Blocks, Rows, Flat, N, n_tokens, cap, BS: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # a row's element: block e // BS, token e % BS
        mask = e < N * BS
        i, j = e // BS, e % BS
        at = r.to(tl.int64) * N + i
        slot = tl.load(Slots + at, mask=mask, other=0)
        block = tl.load(Blocks + at, mask=mask, other=0)
        tl.store(Rows + r.to(tl.int64) * N * BS + e, tl.where(block * BS + j < n_tokens, slot * BS + j, -1), mask=mask)
        tl.store(Flat + at, slot + r * cap, mask=mask & (j == 0))


def block_rows(
    slots: torch.Tensor, blocks: torch.Tensor, block_size: int, n_tokens: int, cap: int, block: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [R, n * bs], flat [R, n]) as block_rows_ref, in one Triton launch (graph-capturable; CPU tensors in
    the Triton interpreter)."""
    assert slots.dtype == blocks.dtype == torch.int32 and slots.shape == blocks.shape, (slots.dtype, blocks.shape)
    slots, blocks = slots.contiguous(), blocks.contiguous()
    r, n = slots.shape
    rows = torch.empty(r, n * block_size, dtype=torch.int32, device=slots.device)
    flat = torch.empty_like(slots)
    if r and n:
        grid = (r, triton.cdiv(n * block_size, block))
        _block_rows_kernel[grid](slots, blocks, rows, flat, n, n_tokens, cap, BS=block_size, BLOCK=block)
    return rows, flat
