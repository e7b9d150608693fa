"""Fused cache lookup + query-label update (spec 2.1): one pass over the queries and the labels.

  q       [B, Hc, G, D]  the (speculative) queries of the cached KV heads, G query heads each
  labels  [B, Hc, G, D]  fp32, the queries each slot was filled for (updated in place on a miss)
  valid   [B, Hc] bool   a slot holds rows (updated in place: True after the call)
  tau     [Hc]           per-head threshold (Eq. 7-9)
  weights [Hc, G]        importance weights of the query heads (Eq. 10)
  force   [Hc] bool      heads refreshed every step (speculative prefetch of hard heads)
  -> miss [B, Hc] bool

Hit when the aggregated cosine similarity >= tau. The label is replaced only on a miss (as HATA's
`check_reuse`). `lookup_and_update_ref` is the specification.
"""
from __future__ import annotations

import torch

from clo.policy.thresholds import aggregate_similarity


def lookup_and_update_ref(q: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, tau: torch.Tensor,
                          weights: torch.Tensor, force: torch.Tensor, aggregation: str) -> torch.Tensor:
    qf = q.float()
    cos = torch.nn.functional.cosine_similarity(qf, labels, dim=-1, eps=1e-12)  # [B, Hc, G]
    sim = aggregate_similarity(cos, weights, aggregation)
    miss = ~valid | (sim < tau) | force
    labels.copy_(torch.where(miss[..., None, None], qf, labels))
    valid.fill_(True)
    return miss
