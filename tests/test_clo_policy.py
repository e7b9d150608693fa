"""CLO's policy pieces on their own: thresholds (Eq. 7-9), GQA aggregation (Eq. 10), the persistent-head plan
(Eq. 11-13), importance and profile files, and the hash retriever's bit arithmetic."""

import math

import pytest
import torch

from clo.policy.persistent import heads_per_layer_time, load_profile, plan_persistent_heads
from clo.policy.thresholds import load_importance, thresholds
from kvoffload.errors import ConfigError
from kvoffload.kernels.hash_score import block_max, hamming, pack_signs
from kvoffload.kernels.head_cache import aggregate_similarity
from kvoffload.offload.retrieval import ExactRetriever, HashRetriever, select_topk


def test_thresholds_endpoints_and_monotone():
    s = torch.tensor([1.0, 0.0, 0.5, 0.9])
    tau = thresholds(s, eta=0.8, n=3)
    assert tau[0] == pytest.approx(0.8, abs=1e-6) and tau[1] == pytest.approx(-1.0, abs=1e-6)
    lam = 0.5**3
    assert tau[2] == pytest.approx(math.cos(lam * math.acos(0.8) + (1 - lam) * math.pi), abs=1e-6)
    assert tau[1] < tau[2] < tau[3] < tau[0]


@pytest.mark.parametrize("eta", [-1.0, 1.5, -3])
def test_eta_outside_range(eta):
    with pytest.raises(ConfigError, match="eta"):
        thresholds(torch.ones(2), eta, 3)


def test_gqa_aggregation():
    cos = torch.tensor([[[0.9, 0.5, 0.7, 0.1]]])
    w = torch.tensor([[1.0, 1.0, 2.0, 0.0]])
    assert aggregate_similarity(cos, w, "mean").item() == pytest.approx((0.9 + 0.5 + 1.4) / 4)
    assert aggregate_similarity(cos, w, "min").item() == pytest.approx(0.1)
    with pytest.raises(ConfigError):
        aggregate_similarity(cos, w, "max")


def test_persistent_plan_eq11_to_13():
    tau = torch.tensor([[0.8, 0.8, 0.8, 0.8], [0.8, -1.0, 0.8, 0.8]])
    s_hat = torch.tensor([[0.95, 0.70, 0.60, 0.85], [0.5, 0.2, 0.95, 0.75]])
    # D = tau - (s_hat - 0.1): layer 0: [-0.05, 0.2, 0.3, 0.05]; layer 1: [0.4, -1.1, -0.05, 0.15]
    plan = plan_persistent_heads(tau, s_hat, epsilon=0.1, n_p=1)
    assert plan.persistent == [[1, 2], [0]]  # the hardest |hard| - N_p heads
    assert plan.prefetch == [[3], [3]]
    assert plan_persistent_heads(tau, s_hat, 0.1, n_p=5).persistent == [[], []]
    assert plan_persistent_heads(tau, s_hat, 0.1, n_p=0, skip_layers=1).persistent == [[], [0, 3]]


def test_heads_per_layer_time_eq12():
    # 100 us of compute at 50 GB/s moves 5 MB: 40 heads of 128 KB
    assert heads_per_layer_time(100e-6, 50e9, 128 * 1024) == 38
    assert heads_per_layer_time(100e-6, 50e9, 0) == 0


def test_importance_files():
    scores, desc = load_importance("Llama-3-8B-Instruct-Gradient-1048k", 32, 8)
    assert scores.shape == (32, 8) and 0 <= scores.min() and scores.max() <= 1 and "DuoAttention" in desc
    with pytest.raises(ConfigError, match="shape"):
        load_importance("Llama-3-8B-Instruct-Gradient-1048k", 30, 3)
    with pytest.raises(ConfigError, match="valid"):
        load_importance("nope", 32, 8)


def test_profile_file_shape_checked():
    s_hat, desc = load_profile("data/profiles/smollm2.json", 30, 3)
    assert s_hat.shape == (30, 3) and (s_hat <= 1).all() and "SmolLM2" in desc
    with pytest.raises(ConfigError, match="shape"):
        load_profile("data/profiles/smollm2.json", 32, 8)


def test_pack_and_hamming_against_bits():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g)
    want = ((x > 0) != (y > 0)).sum(-1)
    assert torch.equal(hamming(pack_signs(x), pack_signs(y)), want.int())


def test_hash_scores_formula_and_exact_scores():
    g = torch.Generator().manual_seed(1)
    b, hkv, grp, t, d, rbit = 2, 2, 3, 20, 16, 64
    keys, q = torch.randn(b, hkv, t, d, generator=g), torch.randn(b, hkv * grp, d, generator=g)
    hr = HashRetriever(1, hkv, d, torch.device("cpu"), rbit=rbit, seed=3)
    hr.index(0, keys)
    heads = torch.arange(hkv)
    got = hr.scores(0, q, heads)
    kb = torch.einsum("bktd,kdr->bktr", keys, hr.proj[0]) > 0
    qb = torch.einsum("bkgd,kdr->bkgr", q.view(b, hkv, grp, d), hr.proj[0]) > 0
    ham = (kb[:, :, None] != qb[:, :, :, None]).sum(-1).sum(2)  # [B, Hkv, T]
    torch.testing.assert_close(got, (grp - 2 * ham / rbit) * keys.norm(dim=-1))
    ex = ExactRetriever(1, hkv, d, torch.device("cpu"))
    ex.index(0, keys)
    torch.testing.assert_close(ex.scores(0, q, heads), torch.einsum("bkgd,bktd->bkt", q.view(b, hkv, grp, d), keys))
    idx = select_topk(ex.scores(0, q, heads), 4, offset=10)
    assert idx.shape == (b, hkv, 4) and (idx >= 10).all() and (idx.diff(dim=-1) > 0).all()


def test_first_radix_pass_counted_beside_the_scores():
    """count_first_pass_ref bins a score by the top byte of its order-preserving key (sign flipped up, negatives
    inverted), and each retriever's scores(hist=) adds exactly that count of what it returns."""
    from kvoffload.kernels.radix_keys import count_first_pass_ref, radix_work

    work = radix_work(2, torch.device("cpu"))
    count_first_pass_ref(torch.tensor([[1.0, 1.5, -1.0], [0.0, -0.0, float("inf")]]), work)
    # 1.0 = 0x3F800000 -> 0xBF800000; -1.0 = 0xBF800000 -> 0x407FFFFF; 0.0 -> 0x80000000; -0.0 -> 0x7FFFFFFF
    assert work[:256].nonzero().flatten().tolist() == [0x40, 0xBF] and work[0xBF] == 2
    assert work[256:512].nonzero().flatten().tolist() == [0x7F, 0x80, 0xFF] and not work[512:].any()
    g = torch.Generator().manual_seed(4)
    keys, q = torch.randn(2, 3, 50, 16, generator=g), torch.randn(2, 6, 16, generator=g)
    for retriever in (HashRetriever(1, 3, 16, torch.device("cpu"), rbit=64), ExactRetriever(1, 3, 16, "cpu")):
        retriever.index(0, keys)
        heads = torch.tensor([2, 0])
        got, want = radix_work(4, torch.device("cpu")), radix_work(4, torch.device("cpu"))
        count_first_pass_ref(retriever.scores(0, q, heads, hist=got), want)
        assert torch.equal(got, want) and got.sum() == 4 * 50
        # pooled (RetroInfer-style's blocks): the block maxima of the same scores, 50 tokens in 7 blocks of 8
        pooled = retriever.scores(0, q, heads, pool=8)
        assert pooled.shape == (2, 2, 7) and torch.equal(pooled, block_max(retriever.scores(0, q, heads), 8))


def test_hash_ranking_tracks_exact_ranking():
    """Random projections with 256 bits recover a good part of the true top-10%: the retriever works."""
    g = torch.Generator().manual_seed(2)
    keys, q = torch.randn(1, 1, 2000, 64, generator=g), torch.randn(1, 4, 64, generator=g)
    keys[0, 0, :200] += 0.5 * q[0].mean(0)  # a planted set of relevant keys
    hr, ex = HashRetriever(1, 1, 64, torch.device("cpu"), rbit=256), ExactRetriever(1, 1, 64, torch.device("cpu"))
    hr.index(0, keys)
    ex.index(0, keys)
    h = torch.arange(1)
    top_h, top_e = (
        set(select_topk(hr.scores(0, q, h), 200, 0).flatten().tolist()),
        set(select_topk(ex.scores(0, q, h), 200, 0).flatten().tolist()),
    )
    assert len(top_h & top_e) / 200 > 0.5
