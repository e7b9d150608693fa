"""RetroInfer's wave index, the part of it that decides what a step retrieves and estimates
(docs/systems.md, "RetroInfer-style"; RetroInfer in microsoft/RetrievalAttention), as an option of the RetroInfer-style
baseline (`retriever=wave`).

At prefill the middle keys of each KV head are clustered: segmented k-means (the context cut into segments
of `segment` tokens, each clustered on its own, `cluster_size` keys per cluster on average, RetroInfer's
default 16 = 2 pages of 8), assignment by cosine, a centroid the mean of its keys. The host store is then laid
out cluster by cluster (`perm`), so a cluster is a run of consecutive pages and the block cache moves whole
clusters. A step scores the centroids with the query (summed over the GQA group) and every position takes its
cluster's score: the top-k positions are whole clusters, best first, the last one cut at the budget.

Estimation zone (`estimate` > 0, RetroInfer's `estimation_budget`): beside each centroid the index keeps its
cluster's size and value sum (in the KV dtype, as RetroInfer). A step's estimation zone is the
round(estimate x clusters) best-scored clusters of which the step retrieves no row; each contributes
exp(q . centroid / sqrt(D)) x size to the softmax's denominator and exp(q . centroid / sqrt(D)) x value sum to
its numerator, as if its keys all equalled its centroid. `attend_with_estimate` merges that with exact
attention over the window and the retrieved rows by log-sum-exp; `estimated_attention_ref`, one softmax over
both written out, is the specification. A cluster the step retrieves only in part (a block straddles two
clusters) is neither estimated nor attended beyond its retrieved rows.
"""

from __future__ import annotations

import math

import torch

from kvoffload.errors import ConfigError
from kvoffload.kernels.decode_attention import decode_attention_ref, merge_attention


def segmented_kmeans(
    keys: torch.Tensor, cluster_size: int, segment: int, iters: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [R, N, D] -> (cluster id of every key [R, N] long, centroids [R, C, D] float32). Deterministic:
    each segment starts from evenly spaced keys of its own."""
    r, n, d = keys.shape
    labels, centroids = [], []
    for s0 in range(0, n, segment):
        seg = keys[:, s0 : s0 + segment].float()
        c = math.ceil(seg.shape[1] / cluster_size)
        unit = torch.nn.functional.normalize(seg, dim=-1)
        cent = seg[:, torch.linspace(0, seg.shape[1] - 1, c, device=keys.device).round().long()]
        for _ in range(iters + 1):
            assign = torch.einsum("rnd,rcd->rnc", unit, torch.nn.functional.normalize(cent, dim=-1)).argmax(-1)
            sums = torch.zeros(r, c, d, device=keys.device).index_put_(
                (torch.arange(r, device=keys.device)[:, None].expand_as(assign), assign), seg, accumulate=True
            )
            count = torch.zeros(r, c, device=keys.device).scatter_add_(1, assign, torch.ones_like(seg[..., 0]))
            cent = torch.where(count[..., None] > 0, sums / count.clamp_min(1)[..., None], cent)  # empty: kept
        labels.append(assign + sum(x.shape[1] for x in centroids))
        centroids.append(cent)
    return torch.cat(labels, 1), torch.cat(centroids, 1)


class WaveRetriever:
    """The retriever interface of kvoffload.offload.retrieval (index, scores, metadata_bytes) over a cluster-ordered
    layout: scores are per position of the permuted store, and `perm[layer]` says which token each position holds.
    With `estimate` > 0 also the estimation zone (estimation_zone)."""

    name = "wave"

    def __init__(
        self, num_layers: int, cluster_size: int = 16, segment: int = 8192, iters: int = 4, estimate: float = 0.0
    ):
        if cluster_size < 1 or segment < cluster_size or iters < 0:
            raise ConfigError(
                f"wave index: cluster_size={cluster_size} >= 1, segment={segment} >= cluster_size "
                f"and iters={iters} >= 0 are required"
            )
        if isinstance(estimate, bool) or not isinstance(estimate, (int, float)) or not 0 <= estimate <= 1:
            raise ConfigError(
                f"wave_estimate={estimate!r}: the estimation zone's fraction of a head's clusters must be in "
                "[0, 1] (0: off; RetroInfer: 0.232)"
            )
        self.cluster_size, self.segment, self.iters, self.estimate = cluster_size, segment, iters, float(estimate)
        self.perm: list[torch.Tensor | None] = [None] * num_layers  # [B, Hkv, N]: position -> token
        self.pos_cluster: list[torch.Tensor | None] = [None] * num_layers  # [B, Hkv, N]: cluster of a position
        self.centroids: list[torch.Tensor | None] = [None] * num_layers  # [B, Hkv, C, D]
        self.sizes: list[torch.Tensor | None] = [None] * num_layers  # [B, Hkv, C] float32, with estimate > 0
        self.value_sums: list[torch.Tensor | None] = [None] * num_layers  # [B, Hkv, C, D] KV dtype, with estimate > 0
        self.cluster_scores: torch.Tensor | None = None  # [B, h, C]: the last scores() call's, per cluster
        zones = f"estimation zone {self.estimate:g} of the clusters" if self.estimate else "no estimation zone"
        self.weights_source = (
            f"wave index (segmented k-means, {cluster_size} keys per cluster, segments of "
            f"{segment}, {iters} iterations; retrieval zone + {zones})"
        )

    def index(self, layer: int, keys: torch.Tensor, values: torch.Tensor | None = None) -> None:
        """keys, values [B, Hkv, N, D] in token order (values: needed with estimate > 0)."""
        b, hkv, n, d = keys.shape
        labels, cent = segmented_kmeans(keys.reshape(b * hkv, n, d), self.cluster_size, self.segment, self.iters)
        perm = labels.argsort(dim=1, stable=True)  # cluster by cluster, tokens in order within a cluster
        self.perm[layer] = perm.view(b, hkv, n)
        self.pos_cluster[layer] = labels.gather(1, perm).view(b, hkv, n)
        self.centroids[layer] = cent.view(b, hkv, -1, d)
        if self.estimate:
            c = cent.shape[1]
            self.sizes[layer] = (
                torch.zeros(b * hkv, c, device=keys.device)
                .scatter_add_(1, labels, torch.ones(labels.shape, device=keys.device))
                .view(b, hkv, c)
            )
            sums = torch.zeros(b * hkv, c, d, device=keys.device).scatter_add_(
                1, labels[..., None].expand(-1, -1, d), values.reshape(b * hkv, n, d).float()
            )
            self.value_sums[layer] = sums.to(values.dtype).view(b, hkv, c, d)

    def scores(
        self,
        layer: int,
        q: torch.Tensor,
        heads: torch.Tensor,
        miss: torch.Tensor | None = None,
        hist: torch.Tensor | None = None,
        pool: int = 1,
    ) -> torch.Tensor:
        """q [B, H, D], heads [h] -> [B, h, N] float32: each position scored by its cluster's centroid. miss, hist:
        as kvoffload.offload.retrieval's (every row is scored; the radix select's first pass is counted in torch).
        pool: the max over each block of `pool` positions, as the other retrievers' (block-granular selection)."""
        from kvoffload.kernels.hash_score import block_max
        from kvoffload.kernels.radix_keys import count_first_pass_ref

        cent = self.centroids[layer][:, heads]
        b, hkv, _, d = self.centroids[layer].shape
        per_cluster = torch.einsum("bkgd,bkcd->bkc", q.view(b, hkv, -1, d)[:, heads].float(), cent)
        self.cluster_scores = per_cluster
        by_position = per_cluster.gather(2, self.pos_cluster[layer][:, heads])
        return count_first_pass_ref(block_max(by_position, pool), hist)

    def estimation_clusters(self, clusters: int) -> int:
        """Clusters per head in a step's estimation zone (RetroInfer: round(estimation_budget x clusters))."""
        return min(clusters, round(self.estimate * clusters))

    def estimation_zone(
        self, layer: int, retrieved: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The estimation zone of the step whose scores() ran last, over every KV head: the best-scored clusters
        none of whose positions `retrieved` [B, Hkv, k] (or [B x Hkv, k]) holds; a position past the middle (the
        last block's padding) counts as the last one, which its block holds. Empty clusters are never in it.
        -> (centroids [B, Hkv, E, D] float32, value sums [B, Hkv, E, D], sizes [B, Hkv, E] float32): size and
        value sum 0 where fewer than E clusters are left."""
        cent, sizes, sums = self.centroids[layer], self.sizes[layer], self.value_sums[layer]
        b, hkv, c, d = cent.shape
        free = sizes > 0
        if retrieved is not None:
            pos = self.pos_cluster[layer]
            at = pos.gather(2, retrieved.reshape(b, hkv, -1).clamp(max=pos.shape[2] - 1))
            free = free.scatter(2, at, False)
        score = self.cluster_scores.masked_fill(~free, float("-inf"))
        ids = score.topk(self.estimation_clusters(c), dim=2).indices  # [B, Hkv, E]
        rows = ids[..., None].expand(-1, -1, -1, d)
        live = free.gather(2, ids)
        return cent.gather(2, rows), sums.gather(2, rows) * live[..., None], sizes.gather(2, ids) * live

    def metadata_bytes(self) -> int:
        """Device bytes: centroids, each position's cluster id, and with the estimation zone the clusters' sizes and
        value sums (the permutation is used once, at prefill)."""
        held = [*self.centroids, *self.pos_cluster, *self.sizes, *self.value_sums]
        return sum(x.nbytes for x in held if x is not None)

    def step_bytes(self) -> int:
        """Device bytes of the index a step reads: all of it but the value sums, of which only the estimation
        zone's."""
        unread = sum(
            x.nbytes // x.shape[2] * (x.shape[2] - self.estimation_clusters(x.shape[2]))
            for x in self.value_sums
            if x is not None
        )
        return self.metadata_bytes() - unread

    def estimate_bytes(self, heads: int, n: int, d: int, dtype_bytes: int = 2) -> int:
        clusters = sum(math.ceil(min(self.segment, n - s) / self.cluster_size) for s in range(0, n, self.segment))
        per_cluster = d * 4 + (4 + d * dtype_bytes if self.estimate else 0)
        return heads * (clusters * per_cluster + n * 8)


def estimate_attention(
    q: torch.Tensor, cent: torch.Tensor, sums: torch.Tensor, sizes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The estimation zone's share of attention, as one part for merge_attention: q [B, H, D]; cent, sums
    [B, Hkv, E, D]; sizes [B, Hkv, E] -> (out [B, H, D] float32, lse [B, H] float32). A cluster weighs
    size x exp(q . centroid / sqrt(D)) and brings its mean value (sum / size)."""
    b, h, d = q.shape
    hkv = cent.shape[1]
    logits = torch.einsum("bkgd,bked->bkge", q.view(b, hkv, -1, d).float(), cent.float()) / math.sqrt(d)
    logits = logits + sizes.log()[:, :, None]  # size 0: -inf, no weight
    lse = logits.logsumexp(-1, keepdim=True)
    mean = sums.float() / sizes.clamp_min(1)[..., None]
    out = torch.einsum("bkge,bked->bkgd", (logits - lse).exp(), mean)
    return out.reshape(b, h, d), lse.reshape(b, h)


def attend_with_estimate(
    q: torch.Tensor, kv: torch.Tensor, keep: torch.Tensor | None, zone: tuple[torch.Tensor, ...]
) -> torch.Tensor:
    """Exact attention over kv [B, Hkv, N, 2, D] (keep [B, Hkv, N] bool: the rows that are tokens, or None: all)
    merged with the estimation zone (estimation_zone's triple) by log-sum-exp. Plain torch ops, no host sync."""
    b = q.shape[0]
    lengths = torch.full((b,), kv.shape[2], dtype=torch.long, device=kv.device)
    rows = None if keep is None else keep.transpose(1, 2)
    exact = decode_attention_ref(q, kv[:, :, :, 0].transpose(1, 2), kv[:, :, :, 1].transpose(1, 2), lengths, True, rows)
    return merge_attention([exact, estimate_attention(q, *zone)])


def estimated_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor | None,
    cent: torch.Tensor,
    sums: torch.Tensor,
    sizes: torch.Tensor,
) -> torch.Tensor:
    """The specification, one softmax written out: q [B, H, D]; k, v [B, Hkv, N, D]; keep [B, Hkv, N] or None;
    cent, sums [B, Hkv, E, D]; sizes [B, Hkv, E] -> [B, H, D]: (sum over kept keys of exp(s) v + sum over
    clusters of exp(s_c) value sum) / (sum of exp(s) + sum of exp(s_c) size), s = q . key / sqrt(D)."""
    b, h, d = q.shape
    hkv = k.shape[1]
    qg = q.view(b, hkv, -1, d).double()
    s = torch.einsum("bkgd,bknd->bkgn", qg, k.double()) / math.sqrt(d)
    if keep is not None:
        s = s.masked_fill(~keep[:, :, None], float("-inf"))
    sc = torch.einsum("bkgd,bked->bkge", qg, cent.double()) / math.sqrt(d)
    m = torch.maximum(s.amax(-1, keepdim=True), sc.amax(-1, keepdim=True))
    e, ec = (s - m).exp(), (sc - m).exp() * sizes.double()[:, :, None]
    num = torch.einsum("bkgn,bknd->bkgd", e, v.double()) + torch.einsum(
        "bkge,bked->bkgd", (sc - m).exp(), sums.double()
    )
    den = e.sum(-1) + ec.sum(-1)
    return (num / den[..., None]).reshape(b, h, d).to(q.dtype)
