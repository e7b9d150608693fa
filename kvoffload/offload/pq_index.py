"""Product-quantisation retrieval (PQCache, Zhang et al. 2024; its public code HugoZHL/PQCache).

At prefill each KV head's middle keys are split into M sub-vectors of head_dim / M channels, and each sub-space is
clustered by k-means into 2^bits centroids: a key becomes M one-byte codes. At decode the query group's sub-vectors
meet every centroid once (a [G, M, C] table of dot products), each key's approximate q.k is the sum of its M table
entries, and, as PQCache's GQA path does, a KV head scores a token by the sum over its query group of the softmax of
those approximate logits. PQCache's defaults, kept here: M = 2, 6 bits (64 centroids), Euclidean k-means.

PQCache clusters on CPU processes while the prefill goes on; here k-means runs where the keys are (Lloyd's
iterations in torch, seeded), a prefill cost the records count as the other retrievers' indexing.

PQRetriever has the retrievers' interface (kvoffload/offload/retrieval.py): index(layer, keys), scores(layer, q,
heads, miss, hist, pool) -> [B, h, T] float32, metadata_bytes()."""

from __future__ import annotations

import math

import torch

from kvoffload.errors import ConfigError
from kvoffload.kernels.hash_score import block_max
from kvoffload.kernels.radix_keys import count_first_pass_ref

SUBVECTORS = 2  # PQCache's n_subvec_per_head
BITS = 6  # PQCache's n_subbits: 64 centroids per sub-space
KMEANS_ITERS = 10  # Lloyd's iterations
# k-means assigns this many (group, token) points at a time: its [points, centroids] distances stay ~16 MB
ASSIGN_POINTS = 1 << 16
# index() clusters this many key values at a time (fp32, twice: the cast and the sub-spaces' copy), a few (sequence,
# KV head) rows together, within experiments.runner.preflight.WORKSPACE_BYTES as the hash retriever's chunked encoding
INDEX_FLOATS = 1 << 24


def kmeans(x: torch.Tensor, clusters: int, iters: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [G, T, d] float32 -> (centroids [G, C, d], codes [G, T] int64), C = min(clusters, T), one k-means per
    group. Initial centroids: C distinct points of each group (a seeded permutation); a cluster left empty keeps
    its centroid (scikit-learn's, which PQCache runs, moves it to a far point instead). Squared Euclidean distances,
    ||x||^2 dropped (equal for every centroid of a point)."""
    g, t, d = x.shape
    c = min(clusters, t)
    gen = torch.Generator().manual_seed(seed)
    first = torch.randperm(t, generator=gen)[:c].to(x.device)
    cent = x[:, first].clone()
    codes = torch.empty(g, t, dtype=torch.long, device=x.device)
    chunk = max(1, ASSIGN_POINTS // max(1, g * c // 64))
    for it in range(iters + 1):
        half_norm = 0.5 * (cent * cent).sum(-1)  # [G, C]
        for s in range(0, t, chunk):  # argmin ||x - c||^2 = argmax x.c - ||c||^2 / 2
            codes[:, s : s + chunk] = (
                torch.bmm(x[:, s : s + chunk], cent.transpose(1, 2)) - half_norm[:, None]
            ).argmax(-1)
        if it == iters:
            break
        sums = torch.zeros_like(cent).scatter_add_(1, codes[..., None].expand(-1, -1, d), x)
        counts = torch.zeros(g, c, device=x.device).scatter_add_(1, codes, torch.ones_like(codes, dtype=x.dtype))
        cent = torch.where(counts[..., None] > 0, sums / counts.clamp(min=1)[..., None], cent)
    return cent, codes


class PQRetriever:
    name = "pq"

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        subvectors: int = SUBVECTORS,
        bits: int = BITS,
        iters: int = KMEANS_ITERS,
        seed: int = 0,
    ):
        if subvectors < 1 or head_dim % subvectors:
            raise ConfigError(f"pq subvectors={subvectors} must divide head_dim {head_dim}")
        if not 1 <= bits <= 8:
            raise ConfigError(f"pq bits={bits} must be 1-8 (one byte a code)")
        self.m, self.bits, self.iters, self.seed = subvectors, bits, iters, seed
        self.weights_source = (
            f"product quantisation ({subvectors} sub-vectors x {1 << bits} centroids, k-means seeded {seed} + layer)"
        )
        self.scale = 1.0 / math.sqrt(head_dim)
        self.centroids: list[torch.Tensor | None] = [None] * num_layers  # [B, Hkv, M, C, D / M] float32
        self.codes: list[torch.Tensor | None] = [None] * num_layers  # [B, Hkv, T, M] uint8

    def index(self, layer: int, keys: torch.Tensor) -> None:
        """keys [B, Hkv, T, D] (a strided view will do) -> each head's sub-space centroids and the keys' codes,
        clustered a few (sequence, KV head) rows at a time (each row's k-means is its own)."""
        b, hkv, t, d = keys.shape
        m, ds, c = self.m, d // self.m, min(1 << self.bits, t)
        cent = torch.empty(b * hkv, m, c, ds, device=keys.device)
        codes = torch.empty(b * hkv, t, m, dtype=torch.uint8, device=keys.device)
        rows = keys.reshape(b * hkv, t, d)
        chunk = max(1, INDEX_FLOATS // max(1, t * d))
        for r in range(0, b * hkv, chunk):
            x = rows[r : r + chunk].float()
            n = x.shape[0]
            sub = x.view(n, t, m, ds).transpose(1, 2).reshape(n * m, t, ds)
            cent_r, codes_r = kmeans(sub, 1 << self.bits, self.iters, self.seed + layer)
            cent[r : r + n] = cent_r.view(n, m, c, ds)
            codes[r : r + n] = codes_r.view(n, m, t).transpose(1, 2).to(torch.uint8)
        self.centroids[layer] = cent.view(b, hkv, m, c, ds)
        self.codes[layer] = codes.view(b, hkv, t, m)

    def approx_logits(self, layer: int, q: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """q [B, H, D] -> each scored KV head's query group's approximate q.k [B, h, G, T], from the table of the
        query's sub-vectors against the centroids."""
        cent, codes = self.centroids[layer][:, heads], self.codes[layer][:, heads]
        b, h, m, c, ds = cent.shape
        t = codes.shape[2]
        hkv = self.codes[layer].shape[1]
        qg = q.view(b, hkv, -1, m, ds)[:, heads].float()  # [B, h, G, M, d]
        g = qg.shape[2]
        table = torch.einsum("bhgmd,bhmcd->bhgmc", qg, cent)
        est = torch.zeros(b, h, g, t, device=q.device)
        for j in range(m):  # one sub-space at a time: a [B, h, G, T] temporary, not M of them
            est += table[:, :, :, j].gather(-1, codes[..., j].long()[:, :, None].expand(-1, -1, g, -1))
        return est

    def scores(
        self,
        layer: int,
        q: torch.Tensor,
        heads: torch.Tensor,
        miss: torch.Tensor | None = None,
        hist: torch.Tensor | None = None,
        pool: int = 1,
    ):
        """q [B, H, D], heads [h] -> [B, h, T] float32: the query group's summed softmax of its approximate logits
        (PQCache's GQA score). miss, hist, pool: as ExactRetriever's (every row is scored here)."""
        probs = torch.softmax(self.approx_logits(layer, q, heads) * self.scale, dim=-1).sum(2)
        return count_first_pass_ref(block_max(probs, pool), hist)

    def metadata_bytes(self) -> int:
        return sum(c.nbytes + k.nbytes for c, k in zip(self.centroids, self.codes) if c is not None)
