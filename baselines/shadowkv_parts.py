"""ShadowKV-style's geometry and arithmetic (baselines/shadowkv.py is the system): how a prompt splits into chunks,
outliers and a local window, the sparse budget, and the low-rank keys, landmarks and chunk scores. After
bytedance-seed/ShadowKV's public code (models/kv_cache.py, ShadowKVCache_CPU: the cache that offloads values), in our
words; docs/systems.md, "ShadowKV-style", says where we differ."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvoffload.errors import ConfigError
from kvoffload.kernels.dense_ops import apply_rotary, cos_sin

# The original's offloading cache rounds the context's chunks down to a multiple of 8 ("ensure self.chunks is
# even", for its copy kernels); the chunks rounded off join the local window.
CHUNK_ALIGN = 8
# The original's outlier rule: outlier_chunk = (sparse_budget // 1024) * 24 (48 chunks at its 2048 budget).
OUTLIERS_PER_1024 = 24


@dataclass(frozen=True)
class Geometry:
    """One prompt's split, per KV head: chunks [0, context) are the context (landmarks and outliers), the last
    `local` tokens stay exact on the device; `select` chunks are attended per step (the budget's, or every landmark's
    chunk where the prompt is shorter than that)."""

    prompt: int
    chunk: int
    context: int  # context chunks
    local: int  # tokens
    outliers: int  # chunks
    select: int  # chunks a step attends beside the outliers and the window
    budget: int  # the sparse budget in tokens, before the clamp to the landmarks

    @property
    def landmarks(self) -> int:
        return self.context - self.outliers

    @property
    def context_tokens(self) -> int:
        return self.context * self.chunk


def outlier_rule(budget: int, fixed: int | None) -> int:
    """`fixed`, else the original's rule; below a 1024-token budget, where that rule keeps no outlier (the original
    never runs there), the same share of the budget rounded up: the outliers hold the chunks no landmark stands for,
    the attention sink's among them, and a matched budget on a short prompt would otherwise lose them all."""
    if fixed is not None:
        return fixed
    if budget >= 1024:
        return (budget // 1024) * OUTLIERS_PER_1024
    return math.ceil(budget * OUTLIERS_PER_1024 / 1024)


def geometry(
    prompt: int,
    chunk: int,
    local_chunks: int,
    budget: int,
    topk_ratio: float | None,
    outlier_chunks: int | None,
) -> Geometry:
    """The split of a `prompt`-token prompt. With topk_ratio, the budget is derived so that a head attends
    ceil(topk_ratio * prompt) prompt tokens in all (outliers and local window counted in it), as the other systems'
    budget rule does (kvoffload/offload/budget.py); else `budget` tokens are selected beside them, as the original."""
    if prompt < chunk:
        raise ConfigError(f"a prompt of {prompt} tokens is shorter than one chunk (chunk_size={chunk})")
    context = max(prompt // chunk - local_chunks, 0)
    context -= context % CHUNK_ALIGN
    local = prompt - context * chunk
    if topk_ratio is not None:
        total = min(math.ceil(topk_ratio * prompt), prompt)
        floor = local + min(outlier_rule(0, outlier_chunks), context) * chunk
        if total < floor:
            raise ConfigError(
                f"topk_ratio={topk_ratio} gives {total} tokens of a {prompt}-token prompt, below the outliers and "
                f"local window ({floor} tokens); raise topk_ratio or lower outlier_chunks/local_chunks"
            )
        budget = (total - local) // chunk * chunk  # the largest budget whose outliers and window still fit
        while budget and budget + min(outlier_rule(budget, outlier_chunks), context) * chunk + local > total:
            budget -= chunk
    outliers = min(outlier_rule(budget, outlier_chunks), context)
    select = min(budget // chunk, context - outliers)
    return Geometry(prompt, chunk, context, local, outliers, select, budget)


# ---- low-rank pre-RoPE keys -----------------------------------------------------------------------------------
def unrotate(k: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Post-RoPE keys [B, Hkv, T, D] at positions 0..T-1 -> the pre-RoPE keys (fp32): RoPE is a rotation by each
    position's angles, undone by the rotation by their negatives."""
    cos, sin = cos_sin(torch.arange(k.shape[2], device=k.device), inv_freq, torch.float32)
    return apply_rotary(k.float(), cos, -sin)


def low_rank(pre: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-RoPE keys [B, Hkv, T, D] -> (U [B, T, rank], SV [B, Hkv, rank, D]), fp32: the truncated SVD of each
    sequence's keys with its KV heads side by side ([T, Hkv * D], one SVD a layer and sequence, as the original's
    get_svd), so that K ~ U @ SV per head. Where the matrix has fewer than `rank` singular values, the factors are
    exact and padded with zeros."""
    b, h, t, d = pre.shape
    u, s, vh = torch.linalg.svd(pre.transpose(1, 2).reshape(b, t, h * d), full_matrices=False)
    r = min(rank, s.shape[-1])
    U = pre.new_zeros(b, t, rank)
    SV = pre.new_zeros(b, h, rank, d)
    U[:, :, :r] = u[:, :, :r]
    SV[:, :, :r] = (s[:, :r, None] * vh[:, :r]).view(b, r, h, d).transpose(1, 2)
    return U, SV


def rebuild(U: torch.Tensor, SV: torch.Tensor, seq: torch.Tensor, head: torch.Tensor, pos: torch.Tensor, inv_freq):
    """The post-RoPE keys [n, c, D] (fp32) of n chunks: sequence seq[n], KV head head[n], positions pos [n, c], from
    U [B, T, rank] and SV [B, Hkv, rank, D], rotated at their positions (the original's gather-GEMM-RoPE kernel)."""
    k = torch.bmm(U[seq[:, None], pos].float(), SV[seq, head].float())
    cos, sin = cos_sin(pos.flatten(), inv_freq, torch.float32)
    return apply_rotary(k, cos.view(*pos.shape, cos.shape[-1]), sin.view(*pos.shape, sin.shape[-1]))


# ---- landmarks, outliers and the chunk scores ---------------------------------------------------------------
def landmarks_and_outliers(k_ctx: torch.Tensor, chunk: int, outliers: int):
    """The context's post-RoPE keys [B, Hkv, C * chunk, D] -> (landmarks [B, Hkv, C - outliers, D] fp32, their chunks
    [B, Hkv, C - outliers] in order, outlier chunks [B, Hkv, outliers]). A landmark is its chunk's mean key; the
    outliers are the chunks whose least similar key is least similar (cosine) to their landmark: the chunks a
    landmark stands for worst."""
    b, h, n, d = k_ctx.shape
    c = n // chunk
    kc = k_ctx.float().view(b, h, c, chunk, d)
    mean = kc.mean(dim=-2)
    worst = F.cosine_similarity(mean[:, :, :, None].expand_as(kc), kc, dim=-1).min(dim=-1).values
    out = worst.topk(outliers, dim=-1, largest=False).indices
    keep = torch.ones(b, h, c, dtype=torch.bool, device=k_ctx.device).scatter_(-1, out, False)
    rest = torch.arange(c, device=k_ctx.device).expand(b, h, c).masked_select(keep).view(b, h, c - outliers)
    return mean.gather(2, rest[..., None].expand(-1, -1, -1, d)), rest, out


def chunk_scores(q: torch.Tensor, landmarks: torch.Tensor) -> torch.Tensor:
    """q [B, H, D], landmarks [B, Hkv, n, D] -> [B, Hkv, n]: each query head's softmax over the landmarks (fp32,
    rounded to the landmarks' dtype), the maximum over the KV head's query group, as the original scores chunks."""
    b, h, d = q.shape
    hkv = landmarks.shape[1]
    s = torch.einsum("bkgd,bknd->bkgn", q.view(b, hkv, h // hkv, d).float(), landmarks.float()) / math.sqrt(d)
    return torch.softmax(s, dim=-1).to(landmarks.dtype).amax(dim=2)


def slot_assignment(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The selected buffer as a cache with fixed shapes (no host sync): old [..., S] the chunk each slot holds (-1:
    none), new [..., S] the chunks selected now -> (the chunk each slot holds next [..., S], which slots must be
    refilled [..., S]). A slot whose chunk is selected again keeps it in place; the freed slots take the newly selected
    chunks in order (the r-th freed slot the r-th new chunk), so nothing kept moves."""
    kept = (old[..., :, None] == new[..., None, :]).any(dim=-1)  # slot s's chunk is selected again
    fresh = ~(new[..., :, None] == old[..., None, :]).any(dim=-1)  # chunk j was not held
    s = new.shape[-1]
    rank = torch.where(fresh, fresh.long().cumsum(-1) - 1, s)  # a fresh chunk's rank, s for the others
    by_rank = new.new_full((*new.shape[:-1], s + 1), -1).scatter_(-1, rank, new)[..., :s]
    free_rank = ((~kept).long().cumsum(-1) - 1).clamp(min=0)
    return torch.where(kept, old, by_rank.gather(-1, free_rank)), ~kept
