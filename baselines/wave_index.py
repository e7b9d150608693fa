"""RetroInfer's wave index, the part of it that decides what a step retrieves (spec 3; RetroInfer in
microsoft/RetrievalAttention), as an option of the RetroInfer-style baseline (`retriever=wave`).

At prefill the middle keys of each KV head are clustered: segmented k-means (the context cut into segments
of `segment` tokens, each clustered on its own, `cluster_size` keys per cluster on average, RetroInfer's
default 16 = 2 pages of 8), assignment by cosine, a centroid the mean of its keys. The host store is then laid
out cluster by cluster (`perm`), so a cluster is a run of consecutive pages and the block cache moves whole
clusters. A step scores the centroids with the query (summed over the GQA group) and every position takes its
cluster's score: the top-k positions are whole clusters, best first, the last one cut at the budget.
Not implemented: RetroInfer's estimation zone (the next-best clusters' attention approximated from their
centroids and value sums); the attended set is the retrieval zone only, which the record states.
"""

from __future__ import annotations

import math

import torch

from kvoffload.errors import ConfigError


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
    layout: scores are per position of the permuted store, and `perm[layer]` says which token each position holds."""

    name = "wave"

    def __init__(self, num_layers: int, cluster_size: int = 16, segment: int = 8192, iters: int = 4):
        if cluster_size < 1 or segment < cluster_size or iters < 0:
            raise ConfigError(
                f"wave index: cluster_size={cluster_size} >= 1, segment={segment} >= cluster_size "
                f"and iters={iters} >= 0 are required"
            )
        self.cluster_size, self.segment, self.iters = cluster_size, segment, iters
        self.perm: list[torch.Tensor | None] = [None] * num_layers  # [B, Hkv, N]: position -> token
        self.pos_cluster: list[torch.Tensor | None] = [None] * num_layers  # [B, Hkv, N]: cluster of a position
        self.centroids: list[torch.Tensor | None] = [None] * num_layers  # [B, Hkv, C, D]
        self.weights_source = (
            f"wave index (segmented k-means, {cluster_size} keys per cluster, segments of "
            f"{segment}, {iters} iterations; retrieval zone only, no estimation zone)"
        )

    def index(self, layer: int, keys: torch.Tensor) -> None:
        """keys [B, Hkv, N, D] in token order."""
        b, hkv, n, d = keys.shape
        labels, cent = segmented_kmeans(keys.reshape(b * hkv, n, d), self.cluster_size, self.segment, self.iters)
        perm = labels.argsort(dim=1, stable=True)  # cluster by cluster, tokens in order within a cluster
        self.perm[layer] = perm.view(b, hkv, n)
        self.pos_cluster[layer] = labels.gather(1, perm).view(b, hkv, n)
        self.centroids[layer] = cent.view(b, hkv, -1, d)

    def scores(
        self,
        layer: int,
        q: torch.Tensor,
        heads: torch.Tensor,
        miss: torch.Tensor | None = None,
        hist: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [B, H, D], heads [h] -> [B, h, N] float32: each position scored by its cluster's centroid. miss, hist:
        as kvoffload.offload.retrieval's (every row is scored; the radix select's first pass is counted in torch)."""
        from kvoffload.kernels.radix_keys import count_first_pass_ref

        cent = self.centroids[layer][:, heads]
        b, hkv, _, d = self.centroids[layer].shape
        per_cluster = torch.einsum("bkgd,bkcd->bkc", q.view(b, hkv, -1, d)[:, heads].float(), cent)
        return count_first_pass_ref(per_cluster.gather(2, self.pos_cluster[layer][:, heads]), hist)

    def metadata_bytes(self) -> int:
        """Device bytes: centroids and each position's cluster id (the permutation is used once, at prefill)."""
        return sum(c.nbytes + p.nbytes for c, p in zip(self.centroids, self.pos_cluster) if c is not None)

    def estimate_bytes(self, heads: int, n: int, d: int) -> int:
        clusters = sum(math.ceil(min(self.segment, n - s) / self.cluster_size) for s in range(0, n, self.segment))
        return heads * (clusters * d * 4 + n * 8)
