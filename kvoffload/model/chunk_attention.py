"""Prefill attention for one chunk of queries (Decoder.prefill): the queries at positions start .. start + C - 1
against every key up to the last of them, causal aligned at the bottom right. SDPA's is_causal aligns at the top
left once q is shorter than k, so a chunk after the first takes one of three paths, fastest first:

  split   (CUDA, Hopper and later) the keys before the chunk, which every query sees, with no mask, and the
          chunk's own keys, square causal: one cuDNN call each, merged by their log-sum-exps. torch (2.11) prefers
          cuDNN's attention there, so the first chunk, and the unchunked prefill before, ran on it; with flash
          attention 2 for the other chunks FullAttn's 128K prefill fell from 10.8K to 8.0K tokens/s
          (results/investigations/chunked_prefill_check/README.md; tests/test_prefill_gpu.py times the two paths)
  flash   (CUDA) flash attention 2, whose own causal mask is bottom-right (torch's causal_lower_right)
  masked  (elsewhere) an explicit mask, a few hundred query rows at a time
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

# The masked path runs at most this many query rows per SDPA call, and fewer where the math path's scores would
# pass MASKED_SCORE_BYTES: the mask (and its float copy) and the scores grow with rows x keys.
MASKED_ROWS = 256
MASKED_SCORE_BYTES = 64 * 1024**2

# The split path is off until tests/test_prefill_gpu.py has passed on a GPU with it (it calls a private aten op
# for cuDNN's log-sum-exp); the GPU tests exercise it directly, and the prefill takes it once this is True.
CUDNN_SPLIT = False

# (q, k, v, causal) -> (attention output [B, H, C, D], log-sum-exp of each query's scaled scores [B, H, C])
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [B, H, C, D]: the queries at positions start .. start + C - 1; k, v [B, Hkv, start + C, D] -> [B, H, C, D].
    Query i sees keys 0 .. start + i."""
    if start == 0:  # square: both alignments agree (and SDPA picks its fastest kernel)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if CUDNN_SPLIT and q.is_cuda and _cudnn_split_usable(q, k, v, start):
        return split_causal_attention(q, k, v, start, _cudnn_attend)
    if q.is_cuda and _flash_usable(q, k, v):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]), enable_gqa=True
        )
    return masked_causal_attention(q, k, v, start)


def split_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, attend: Attend):
    """causal_attention as two unmasked-or-square problems: the keys before `start` (every query sees them all) and
    the chunk's own keys (square causal), merged by the share of the softmax mass each holds, in place in the first
    one's output: alive at once q and the two outputs (preflight.prefill_peak_bytes counts three q-sized)."""
    o1, lse1 = attend(q, k[:, :, :start], v[:, :, :start], False)
    o2, lse2 = attend(q, k[:, :, start:], v[:, :, start:], True)
    share = torch.sigmoid(lse1 - lse2).unsqueeze(-1)  # exp(lse1) / (exp(lse1) + exp(lse2)), in fp32
    return o1.sub_(o2).mul_(share).add_(o2)  # share * o1 + (1 - share) * o2


def masked_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    c, keys = q.shape[2], k.shape[2]
    out = torch.empty_like(q)
    rows = max(1, min(MASKED_ROWS, MASKED_SCORE_BYTES // (4 * q.shape[0] * q.shape[1] * keys)))
    for r in range(0, c, rows):
        n = min(r + rows, c)
        mask = torch.ones(n - r, start + n, dtype=torch.bool, device=q.device).tril(start + r)
        out[:, :, r:n] = F.scaled_dot_product_attention(
            q[:, :, r:n], k[:, :, : start + n], v[:, :, : start + n], attn_mask=mask, enable_gqa=True
        )
    return out


def _cudnn_attend(q, k, v, causal):
    """cuDNN's SDPA with its log-sum-exp (not in F.scaled_dot_product_attention's results); it takes fewer KV heads
    than query heads as they are (GQA)."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False)
    return out[0], out[1].reshape(q.shape[:3])


def _cudnn_split_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> bool:
    from torch.backends.cuda import SDPAParams, can_use_cudnn_attention

    if torch.cuda.get_device_capability(q.device)[0] < 9:
        return False
    before = SDPAParams(q, k[:, :, :start], v[:, :, :start], None, 0.0, False, True)
    own = SDPAParams(q, k[:, :, start:], v[:, :, start:], None, 0.0, True, True)
    return can_use_cudnn_attention(before) and can_use_cudnn_attention(own)


def _flash_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    return can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, True))
