"""PQCache's product-quantisation retrieval (kvoffload/offload/pq_index.py) against exact q.k."""

import pytest
import torch

from kvoffload.errors import ConfigError
from kvoffload.offload.pq_index import PQRetriever, kmeans
from kvoffload.offload.retrieval import metadata_bytes_per_head

CPU = torch.device("cpu")
B, HKV, G, D = 2, 2, 3, 16


def keys_and_query(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, HKV, t, D, generator=g), torch.randn(B, HKV * G, D, generator=g)


def quantisation_error(x, cent, codes):
    return ((x - cent.gather(1, codes[..., None].expand(-1, -1, x.shape[-1]))) ** 2).sum().item()


def test_kmeans_iterations_lower_the_quantisation_error():
    x = torch.randn(3, 500, 4, generator=torch.Generator().manual_seed(1))
    start = quantisation_error(x, *kmeans(x, 16, 0, seed=0))
    cent, codes = kmeans(x, 16, 10, seed=0)
    assert cent.shape == (3, 16, 4) and codes.shape == (3, 500)
    assert quantisation_error(x, cent, codes) < 0.8 * start
    # each point is coded by its nearest centroid
    assert torch.equal(codes, torch.cdist(x, cent).argmin(-1))


def test_as_many_centroids_as_keys_is_exact():
    """With no more keys than centroids every key is its own centroid: the approximate logits are q.k and the
    score is the query group's summed softmax of them."""
    k, q = keys_and_query(40)
    r = PQRetriever(1, HKV, D, CPU, subvectors=4)
    r.index(0, k)
    heads = torch.arange(HKV)
    exact = torch.einsum("bkgd,bktd->bkgt", q.view(B, HKV, G, D), k)
    torch.testing.assert_close(r.approx_logits(0, q, heads), exact, rtol=1e-5, atol=1e-5)
    want = torch.softmax(exact / D**0.5, dim=-1).sum(2)
    torch.testing.assert_close(r.scores(0, q, heads), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r.scores(0, q, heads[1:]), want[:, 1:], rtol=1e-5, atol=1e-6)


def test_pq_topk_finds_most_of_the_exact_topk():
    """Keys with structure (a few directions) and a query near one: PQ's top 10 % overlaps the exact top 10 % far
    more than chance (10 %) or two centroids a sub-space do."""
    g = torch.Generator().manual_seed(2)
    t, k = 2048, 205
    dirs = torch.randn(8, D, generator=g)
    keys = dirs[torch.randint(0, 8, (B, HKV, t), generator=g)] + 0.5 * torch.randn(B, HKV, t, D, generator=g)
    q = (dirs[0] + 0.3 * torch.randn(B, HKV * G, D, generator=g)) * 2
    r = PQRetriever(1, HKV, D, CPU)
    r.index(0, keys)
    heads = torch.arange(HKV)
    exact = torch.softmax(torch.einsum("bkgd,bktd->bkgt", q.view(B, HKV, G, D), keys) / D**0.5, -1).sum(2)
    got, want = r.scores(0, q, heads).topk(k).indices, exact.topk(k).indices
    overlap = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(got.flatten(0, 1), want.flatten(0, 1)))
    assert overlap / (B * HKV * k) > 0.75  # 0.88 here; 0.48 with 1 bit (2 centroids)


def test_metadata_bytes_match_the_estimate():
    for t in (40, 300):  # fewer keys than centroids, and more
        k, _ = keys_and_query(t)
        r = PQRetriever(2, HKV, D, CPU)
        r.index(1, k)
        assert r.metadata_bytes() == B * HKV * metadata_bytes_per_head("pq", 256, D, 4, t)


def test_pooled_scores_are_block_maxima():
    k, q = keys_and_query(100)
    r = PQRetriever(1, HKV, D, CPU)
    r.index(0, k)
    heads = torch.arange(HKV)
    tok = r.scores(0, q, heads)
    pooled = r.scores(0, q, heads, pool=8)
    assert pooled.shape == (B, HKV, 13)
    torch.testing.assert_close(pooled[..., :12], tok[..., :96].unflatten(-1, (12, 8)).amax(-1))
    torch.testing.assert_close(pooled[..., 12], tok[..., 96:].amax(-1))


@pytest.mark.parametrize("kw, msg", [(dict(subvectors=3), "divide head_dim"), (dict(bits=9), "1-8")])
def test_bad_settings_are_refused(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        PQRetriever(1, HKV, D, CPU, **kw)


def test_an_empty_middle_has_no_codes():
    """A prompt no longer than sink + recent leaves no candidates: CLO indexes them anyway."""
    k, q = keys_and_query(0)
    r = PQRetriever(1, HKV, D, CPU)
    r.index(0, k)
    assert r.scores(0, q, torch.arange(HKV)).shape == (B, HKV, 0) and r.metadata_bytes() == 0


def test_chunked_index_clusters_each_row_alone(monkeypatch):
    """index() clusters a few (sequence, KV head) rows at a time: one row at a time gives the same codes."""
    from kvoffload.offload import pq_index

    k, q = keys_and_query(300)
    whole = PQRetriever(1, HKV, D, CPU)
    whole.index(0, k)
    monkeypatch.setattr(pq_index, "INDEX_FLOATS", 1)
    one = PQRetriever(1, HKV, D, CPU)
    one.index(0, k)
    assert torch.equal(whole.codes[0], one.codes[0]) and torch.equal(whole.centroids[0], one.centroids[0])
