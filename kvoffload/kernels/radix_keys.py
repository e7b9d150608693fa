"""What the hash-score kernel and the radix select share: the order-preserving 32-bit key of an fp32 score, the
select's scratch (whose first pass a score producer may count), and the row mask of CLO's lookup result.
Both kernels import from here, so that neither imports the other."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: the references are used
    triton = None

PASSES, BINS = 4, 256  # one pass per byte of the key (the kernels are written for these)


def radix_work(rows: int, device: torch.device) -> torch.Tensor:
    """The select's zeroed scratch: the four passes' histograms [PASSES, rows, BINS], then two counters per row.
    A producer of the scores may count the first pass into it (hash_scores(..., hist=)); radix_topk(work=)
    then starts at the second."""
    return torch.zeros(PASSES * rows * BINS + 2 * rows, dtype=torch.int32, device=device)


def count_first_pass_ref(scores: torch.Tensor, work: torch.Tensor | None) -> torch.Tensor:
    """Adds the first pass's histogram of scores [..., T] (rows flattened) to `work`, in torch: the top byte of
    each score's order-preserving key (what _histogram_kernel counts with P = 0). Returns scores; with work None
    there is nothing to count (a retriever's scores(hist=None))."""
    if work is None:
        return scores
    u = scores.reshape(-1, scores.shape[-1]).float().contiguous().view(torch.int32).long() & 0xFFFFFFFF
    key = torch.where(u >= 2**31, u ^ 0xFFFFFFFF, u | 2**31)
    rows = torch.arange(key.shape[0], device=key.device)[:, None]
    bins = (rows * BINS + (key >> 24)).flatten().to(work.device)
    # scatter_add, not bincount: bincount reads its input's range back to the host (a sync, and no graph capture)
    work.scatter_add_(0, bins, torch.ones_like(bins, dtype=work.dtype))
    return scores


def miss_rows(miss: torch.Tensor | None, batch: int, unread: torch.Tensor) -> tuple[torch.Tensor, int]:
    """miss [B, nc] bool -> (its bytes, contiguous, nc) as the kernels read them; with None, (`unread`, 0): any
    tensor on the device, which the kernel does not read (no allocation, so no extra launch in a graph)."""
    if miss is None:
        return unread, 0
    assert miss.dtype == torch.bool and miss.shape[0] == batch, (miss.dtype, miss.shape)
    return miss.contiguous().view(torch.uint8), miss.shape[1]


if triton is not None:

    @triton.jit
    def needed(Miss, b, j, NC):
        """Whether row (b, j) is scored: heads j < NC only where CLO's lookup missed (Miss [B, NC] uint8)."""
        return (j >= NC) | (tl.load(Miss + b * NC + j, mask=j < NC, other=1) != 0)

    @triton.jit
    def order_key(x):
        """fp32 -> uint32 whose unsigned order is the float order (negatives flipped, positives above them)."""
        u = x.to(tl.uint32, bitcast=True)
        return tl.where((u >> 31) != 0, u ^ 0xFFFFFFFF, u | 0x80000000)  # xor, not ~: the interpreter under numpy 2
