"""Fused cache lookup + query-label update (docs/systems.md, "Head cache"): one pass over the queries and the labels.

  q       [B, Hc, G, D]  the (speculative) queries of the cached KV heads, G query heads each
  labels  [B, Hc, G, D]  fp32, the queries each slot was filled for (updated in place on a miss)
  valid   [B, Hc] bool   a slot holds rows (updated in place: True after the call)
  tau     [Hc]           per-head threshold (Eq. 7-9)
  weights [Hc, G]        importance weights of the query heads (Eq. 10)
  force   [Hc] bool      heads refreshed every step (speculative prefetch of hard heads)
  -> miss [B, Hc] bool

Hit when the aggregated cosine similarity >= tau. The label is replaced only on a miss (as HATA's
`check_reuse`). `lookup_and_update_ref` is the specification; `lookup_and_update` picks the Triton kernel (one
program per (b, cached head), no host sync, so it can be captured in a CUDA graph) on CUDA and the reference
elsewhere.
"""

from __future__ import annotations

import torch

from kvoffload.errors import ConfigError

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: the reference is used
    triton = None


AGGREGATIONS = ("mean", "min")


def aggregate_similarity(cos: torch.Tensor, weights: torch.Tensor, how: str) -> torch.Tensor:
    """cos [B, Hkv, G] per query head -> one similarity per KV head [B, Hkv].
    mean: importance-weighted mean (Eq. 10); min: the conservative ablation."""
    if how == "mean":
        w = weights.clamp_min(1e-6)  # all-zero importance in a group: a plain mean
        return (cos * w).sum(-1) / w.sum(-1)
    if how == "min":
        return cos.amin(-1)
    raise ConfigError(f"gqa_aggregation={how!r}; valid: {', '.join(AGGREGATIONS)}")


def lookup_and_update_ref(
    q: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    tau: torch.Tensor,
    weights: torch.Tensor,
    force: torch.Tensor,
    aggregation: str,
) -> torch.Tensor:
    qf = q.float()
    cos = torch.nn.functional.cosine_similarity(qf, labels, dim=-1, eps=1e-12)  # [B, Hc, G]
    sim = aggregate_similarity(cos, weights, aggregation)
    miss = ~valid | (sim < tau) | force
    labels.copy_(torch.where(miss[..., None, None], qf, labels))
    valid.fill_(True)
    return miss


if triton is not None:

    @triton.jit
    def _lookup_kernel(
        Q,
        Labels,
        Valid,
        Tau,
        Weights,
        Force,
        Miss,
        stride_qb,
        stride_qh,
        stride_qg,
        stride_lb,
        stride_lh,
        stride_lg,
        stride_wh,
        HC: tl.constexpr,
        G: tl.constexpr,
        G_PAD: tl.constexpr,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        MEAN: tl.constexpr,
    ):
        bc = tl.program_id(0)
        b = bc // HC
        c = bc % HC
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        gmask = g < G
        mask = gmask[:, None] & (d < D)[None, :]
        q = tl.load(Q + b * stride_qb + c * stride_qh + g[:, None] * stride_qg + d[None, :], mask=mask, other=0.0).to(
            tl.float32
        )
        lab_ptr = Labels + b * stride_lb + c * stride_lh + g[:, None] * stride_lg + d[None, :]
        lab = tl.load(lab_ptr, mask=mask, other=0.0)
        # as torch.cosine_similarity: each vector divided by max(|x|, eps) before the dot product
        qn = tl.maximum(tl.sqrt(tl.sum(q * q, 1)), 1e-12)
        ln = tl.maximum(tl.sqrt(tl.sum(lab * lab, 1)), 1e-12)
        cos = tl.sum((q / qn[:, None]) * (lab / ln[:, None]), 1)  # [G_PAD]
        if MEAN:  # Eq. 10; padded query heads weigh 0
            w = tl.maximum(tl.load(Weights + c * stride_wh + g, mask=gmask, other=0.0), 1e-6)
            w = tl.where(gmask, w, 0.0)
            sim = tl.sum(cos * w, 0) / tl.sum(w, 0)
        else:
            sim = tl.min(tl.where(gmask, cos, float("inf")), 0)
        miss = (tl.load(Valid + bc) == 0) | (sim < tl.load(Tau + c)) | (tl.load(Force + c) != 0)
        # the label moves to q only on a miss (where, not `mask & miss`: the interpreter mistypes block & scalar)
        tl.store(lab_ptr, q, mask=tl.where(miss, mask, False))
        tl.store(Valid + bc, 1)
        tl.store(Miss + bc, miss.to(tl.uint8))


def lookup_and_update_triton(
    q: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    tau: torch.Tensor,
    weights: torch.Tensor,
    force: torch.Tensor,
    aggregation: str,
) -> torch.Tensor:
    if aggregation not in AGGREGATIONS:
        raise ConfigError(f"gqa_aggregation={aggregation!r}; valid: {', '.join(AGGREGATIONS)}")
    b, hc, g, d = q.shape
    assert labels.shape == q.shape and labels.dtype == torch.float32 and valid.shape == (b, hc)
    assert q.stride(3) == labels.stride(3) == 1 and valid.is_contiguous(), "in-place outputs must be plain"
    miss = torch.empty(b, hc, dtype=torch.bool, device=q.device)
    if not (b and hc):
        return miss
    weights = weights.float().contiguous()
    _lookup_kernel[(b * hc,)](
        q,
        labels,
        valid.view(torch.uint8),
        tau.float().contiguous(),
        weights,
        force.contiguous().view(torch.uint8),
        miss.view(torch.uint8),
        q.stride(0),
        q.stride(1),
        q.stride(2),
        labels.stride(0),
        labels.stride(1),
        labels.stride(2),
        weights.stride(0),
        HC=hc,
        G=g,
        G_PAD=triton.next_power_of_2(g),
        D=d,
        D_PAD=triton.next_power_of_2(d),
        MEAN=aggregation == "mean",
        num_warps=1 if g * d <= 1024 else 4,
    )
    return miss


def lookup_and_update(
    q: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    tau: torch.Tensor,
    weights: torch.Tensor,
    force: torch.Tensor,
    aggregation: str,
) -> torch.Tensor:
    if q.is_cuda and triton is not None:
        return lookup_and_update_triton(q, labels, valid, tau, weights, force, aggregation)
    return lookup_and_update_ref(q, labels, valid, tau, weights, force, aggregation)
