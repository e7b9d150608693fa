"""RetroInfer's estimation zone (baselines/wave_index.py, `retriever=wave`, `wave_estimate`) on the CPU: the merged
attention equals its one-softmax specification; the zone is the best-scored clusters the step does not retrieve;
with clusters of one key and a zone covering every other cluster RetroInfer-style equals full attention; on
clustered keys the estimate is closer to full attention than the retrieval zone alone; the index's extra bytes are
real buffers the estimate sees; bad values are refused before prefill. GQA (4 query heads per KV head), batch 2."""

import pytest
import torch

from baselines.retroinfer import RetroInfer
from baselines.wave_index import WaveRetriever, attend_with_estimate, estimated_attention_ref
from kvoffload.errors import ConfigError
from kvoffload.kv.interface import KVSpec
from tests.reference import exact_topk_attention

B, H, HKV, D, L, STEPS = 2, 8, 2, 16, 2, 3
SINK, RECENT = 4, 8
CPU = torch.device("cpu")


def spec(t0: int, device: torch.device = CPU) -> KVSpec:
    # on CUDA the runner hands systems the measured link; any value does here: no test reads time
    return KVSpec(L, B, t0 + STEPS, H, HKV, D, torch.float32, device, prompt_len=t0, link_gb_s=50.0)


def run(t0: int, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, device=CPU, **kw):
    """RetroInfer-style with the wave index over a given prompt (keys, values [L, B, Hkv, t0, D]) and decode queries
    [STEPS, L, B, H, D] (each step's new key/value: small random); -> (outputs [step][layer], data, system)."""
    s = RetroInfer(**{**dict(sink=SINK, recent=RECENT, dense_layers=0, cpu_threads=1, retriever="wave"), **kw})
    s.allocate(spec(t0, device))
    for layer in range(L):
        s.prefill(layer, keys[layer].to(device), values[layer].to(device))
    s.end_prefill(t0)
    g = torch.Generator().manual_seed(1)
    outs, data = [], []
    for step in range(STEPS):
        row = [
            tuple(x.to(device) for x in (queries[step, layer], *torch.randn(2, B, HKV, D, generator=g)))
            for layer in range(L)
        ]
        data.append(row)
        s.begin_step()
        outs.append([s.decode(layer, *row[layer]) for layer in range(L)])
        s.end_step()
    return outs, data, s


def full_attention(keys, values, data, t0):
    return exact_topk_attention(keys, values, data, SINK, RECENT, t0 - SINK - RECENT)


def test_merged_attention_equals_its_one_softmax_specification():
    """attend_with_estimate (exact part and estimate, merged by log-sum-exp) against estimated_attention_ref, with
    masked rows, empty (size 0) zone entries and a sequence whose zone is empty."""
    g = torch.Generator().manual_seed(0)
    n, e = 20, 6
    q = torch.randn(B, H, D, generator=g) * 2
    kv = torch.randn(B, HKV, n, 2, D, generator=g)
    keep = torch.rand(B, HKV, n, generator=g) > 0.3
    keep[..., 0] = True
    cent, sums = torch.randn(B, HKV, e, D, generator=g), torch.randn(B, HKV, e, D, generator=g) * 5
    sizes = torch.randint(1, 30, (B, HKV, e), generator=g).float()
    sizes[0, 1, 2:] = 0
    sizes[1] = 0  # no cluster estimated for sequence 1
    sums = sums * (sizes > 0)[..., None]  # an entry of size 0 is no cluster
    for mask in (keep, None):
        got = attend_with_estimate(q, kv, mask, (cent, sums, sizes))
        want = estimated_attention_ref(q, kv[..., 0, :], kv[..., 1, :], mask, cent, sums, sizes)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_the_zone_is_the_best_scored_clusters_the_step_does_not_retrieve():
    g = torch.Generator().manual_seed(0)
    n = 96
    w = WaveRetriever(1, cluster_size=8, segment=n, iters=2, estimate=0.25)
    w.index(0, torch.randn(B, HKV, n, D, generator=g), torch.randn(B, HKV, n, D, generator=g))
    w.sizes[0][0, 0, 3] = 0  # an empty cluster is never estimated
    q = torch.randn(B, H, D, generator=g)
    w.scores(0, q, torch.arange(HKV))
    retrieved = torch.randint(0, n + 4, (B, HKV, 10), generator=g)  # positions >= n: the last block's padding
    cent, _, sizes = w.estimation_zone(0, retrieved)
    c = w.centroids[0].shape[2]
    e = w.estimation_clusters(c)
    assert e == round(0.25 * c) and cent.shape == (B, HKV, e, D)
    for b in range(B):
        for h in range(HKV):
            taken = set(w.pos_cluster[0][b, h, retrieved[b, h].clamp(max=n - 1)].tolist())
            free = [j for j in range(c) if j not in taken and w.sizes[0][b, h, j] > 0]
            best = sorted(free, key=lambda j: -w.cluster_scores[b, h, j].item())[:e]
            torch.testing.assert_close(cent[b, h, : len(best)], w.centroids[0][b, h, best])
            assert (sizes[b, h, : len(best)] == w.sizes[0][b, h, best]).all() and (sizes[b, h, len(best) :] == 0).all()


@pytest.mark.parametrize("selection, block_size", [("block", 8), ("token", 5)])
def test_one_key_clusters_all_estimated_equal_full_attention(selection, block_size):
    """wave_cluster_size 1: every key its own cluster (centroid = the key, value sum = its value, size 1); with the
    zone covering every cluster the step does not retrieve, attention over the retrieval zone plus the estimate is
    attention over every token. The middle (111) is not a multiple of the block: the padding path is exercised."""
    t0 = 123
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, L, B, HKV, t0, D, generator=g)
    queries = torch.randn(STEPS, L, B, H, D, generator=g)
    kw = dict(wave_cluster_size=1, wave_estimate=1.0, topk_ratio=0.25, selection=selection, block_size=block_size)
    got, data, s = run(t0, keys, values, queries, **kw)
    want = full_attention(keys, values, data, t0)
    for step in range(STEPS):
        for layer in range(L):
            torch.testing.assert_close(got[step][layer], want[step][layer], atol=1e-5, rtol=1e-4)
    zones = s.describe()["wave_zones"]
    assert zones["clusters_per_head"] == t0 - SINK - RECENT == zones["estimation_clusters_per_head"]
    # the same run without the zone attends the top-k only: not full attention
    off = run(t0, keys, values, queries, **{**kw, "wave_estimate": 0})[0]
    assert (off[0][0] - want[0][0]).abs().max() > 1e-2


@pytest.mark.slow
def test_on_clustered_keys_the_estimate_is_closer_to_full_attention():
    """Keys around 24 centres per head (tokens interleaved), values random, queries along random mixes of centres:
    RetroInfer-style with its estimation zone (RetroInfer's 0.232, and every cluster) against the retrieval zone
    alone, at top-k 10 %. Error: the max over outputs of |out - full attention|, per step and layer."""
    t0 = 1012
    g = torch.Generator().manual_seed(0)
    centres = torch.nn.functional.normalize(torch.randn(L, B, HKV, 24, D, generator=g), dim=-1) * 3
    which = torch.randint(0, 24, (L, B, HKV, t0), generator=g)
    keys = centres.gather(3, which[..., None].expand(-1, -1, -1, -1, D)) + 0.3 * torch.randn(
        L, B, HKV, t0, D, generator=g
    )
    values = torch.randn(L, B, HKV, t0, D, generator=g)
    mix = torch.randn(STEPS, L, B, HKV, 24, generator=g).softmax(-1)
    queries = torch.einsum("slbkc,lbkcd->slbkd", mix, centres).repeat_interleave(H // HKV, dim=3) * 2
    queries = queries + 0.5 * torch.randn(queries.shape, generator=g)
    errors = {}
    for estimate in (0, 0.232, 1.0):
        got, data, _ = run(t0, keys, values, queries, wave_estimate=estimate, topk_ratio=0.1)
        want = full_attention(keys, values, data, t0)
        errors[estimate] = torch.tensor(
            [(got[s][la] - want[s][la]).abs().max().item() for s in range(STEPS) for la in range(L)]
        )
    assert (errors[0.232] < errors[0]).all() and (errors[1.0] < errors[0.232]).all(), errors


def test_the_index_bytes_are_real_buffers_that_the_estimate_and_a_step_see():
    t0 = 123
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, L, B, HKV, t0, D, generator=g)
    queries = torch.randn(STEPS, L, B, H, D, generator=g)
    sizes = {}
    for estimate in (0, 0.5):
        _, _, s = run(t0, keys, values, queries, wave_estimate=estimate, wave_segment=40, topk_ratio=0.25)
        parts = s.memory_parts()
        assert parts == s.estimate_parts(spec(t0))
        sizes[estimate] = parts["metadata"]
        w = s.retriever
        c = w.centroids[0].shape[2]
        rows = L * B * HKV * (SINK + RECENT + STEPS + 1 + s.k_select(t0)) * 2 * D * 4  # what the next step attends
        # a step reads the whole index but the value sums, of those only its zone's
        zone = L * B * HKV * w.estimation_clusters(c) * D * 4 if estimate else 0
        assert s.step_device_bytes() == rows + parts["metadata"] - L * B * HKV * c * D * 4 * (estimate > 0) + zone
        assert all(x is not None for x in w.sizes + w.value_sums) == (estimate > 0)
    clusters = L * B * HKV * w.centroids[0].shape[2]
    assert sizes[0.5] - sizes[0] == clusters * (D * 4 + 4)  # value sums (float32 KV here) and sizes
    assert "estimation zone 0.5" in s.describe()["retriever"]


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "half", True])
def test_a_bad_estimate_is_refused_before_prefill_with_the_valid_range(bad):
    with pytest.raises(ConfigError, match=r"\[0, 1\]") as err:
        RetroInfer(retriever="wave", wave_estimate=bad)
    assert "\n" not in str(err.value)


@pytest.mark.gpu
def test_on_cuda_one_key_clusters_all_estimated_equal_full_attention():
    """The option runs on the GPU: there too, clusters of one key all estimated (the zone covering every cluster
    not retrieved) give attention over every token."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA; run on the GPU machine")
    t0 = 123
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, L, B, HKV, t0, D, generator=g)
    queries = torch.randn(STEPS, L, B, H, D, generator=g)
    kw = dict(wave_cluster_size=1, wave_estimate=1.0, topk_ratio=0.25)
    got, data, s = run(t0, keys, values, queries, device=torch.device("cuda"), **kw)
    data = [[tuple(x.cpu() for x in row) for row in step] for step in data]
    want = full_attention(keys, values, data, t0)
    for step in range(STEPS):
        for layer in range(L):
            torch.testing.assert_close(got[step][layer].cpu(), want[step][layer], atol=1e-4, rtol=1e-3)
    assert s.describe()["wave_zones"]["estimation_clusters_per_head"] == t0 - SINK - RECENT
