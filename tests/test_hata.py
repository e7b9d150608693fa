"""Learned HATA hash weights (experiments.producers.train_hata) and their use: training beats a random projection on a
small synthetic set whose q . k lives in a subspace; CLO and RetroInfer load a weights file, name it in their record and
refuse a missing one, another model's or another rbit's; the importance proxy and its file load."""

import json

import pytest
import torch

from baselines.retroinfer import RetroInfer
from clo.policy.thresholds import load_importance
from clo.system import CLO
from experiments.producers.head_importance import importance, middle_mass
from experiments.producers.train_hata import DEFAULTS, train_layer
from kvoffload.errors import ConfigError
from kvoffload.kv.interface import KVSpec
from kvoffload.offload.retrieval import (
    HashRetriever,
    load_hash_weights,
    make_retriever,
    save_hash_weights,
    select_topk,
    simhash_weights,
)
from kvoffload.paths import ROOT
from tests.baseline_helpers import feed

B, H, HKV, D, L, T0, STEPS = 2, 8, 2, 16, 3, 123, 4
CPU = torch.device("cpu")


def spec():
    return KVSpec(L, B, T0 + STEPS, H, HKV, D, torch.float32, CPU)


def subspace_data(seed: int, hkv=2, steps=24, group=2, t=400, d=16):
    """Queries that live in 2 of d dimensions: q . k ignores the other d - 2 coordinates of the keys, which a random
    projection hashes all the same (noise to it) and a learned one can drop."""
    g = torch.Generator().manual_seed(seed)
    q = torch.zeros(hkv, steps, group, d)
    q[..., :2] = torch.randn(hkv, steps, group, 2, generator=g) * 3
    k = torch.randn(hkv, t, d, generator=g)
    return q, k


def recall(w, q, k, frac=0.1):
    """HashRetriever's top-k against the exact top-k (sum over the group of q . k), mean over heads and queries."""
    hkv, steps, group, d = q.shape
    n = round(frac * k.shape[1])
    r = HashRetriever(1, hkv, d, CPU, w.shape[-1], weights=w[None])
    r.index(0, k[None].expand(steps, -1, -1, -1))
    qs = q.permute(1, 0, 2, 3).flatten(1, 2)  # [steps, H, D]
    got = select_topk(r.scores(0, qs, torch.arange(hkv)), n, 0, method="torch")
    best = torch.einsum("hsgd,htd->sht", q, k).topk(n, -1).indices
    mask = torch.zeros(steps, hkv, k.shape[1], dtype=torch.bool).scatter_(-1, best, True)
    return float(mask.gather(-1, got).float().mean())


@pytest.mark.slow
def test_training_lowers_the_loss_and_beats_the_random_projection():
    train = [subspace_data(s) for s in (1, 2)]
    q_test, k_test = subspace_data(3)
    w0 = simhash_weights(1, 2, 16, 32, 0)[0]
    s = {**DEFAULTS, "rbit": 32, "steps": 60, "keys_per_step": 256, "queries_per_step": 8}
    w, first, last = train_layer(train, w0, s, torch.Generator().manual_seed(0))
    assert last < first
    assert recall(w, q_test, k_test) > recall(w0, q_test, k_test) + 0.1


def weights_file(tmp_path, shape=(L, HKV, D, 64), name="w.safetensors"):
    path = tmp_path / name
    save_hash_weights(path, torch.randn(*shape).half(), {"model": "test"})
    return path


def test_the_retriever_loads_learned_weights_and_refuses_wrong_ones(tmp_path):
    path = weights_file(tmp_path)
    r = make_retriever("hash", L, HKV, D, CPU, 64, 0, str(path))
    assert r.weights_source == "learned (w.safetensors)"
    assert torch.equal(r.proj, load_hash_weights(str(path), L, HKV, D, 64)[0])
    assert "SimHash" in make_retriever("hash", L, HKV, D, CPU, 64, 0).weights_source
    with pytest.raises(ConfigError, match="rbit 64, the system's rbit is 128"):
        make_retriever("hash", L, HKV, D, CPU, 128, 0, str(path))
    wrong = weights_file(tmp_path, (L + 1, HKV, D, 64), "other.safetensors")
    with pytest.raises(ConfigError, match="another model"):
        make_retriever("hash", L, HKV, D, CPU, 64, 0, str(wrong))
    with pytest.raises(ConfigError, match="no such file"):
        make_retriever("hash", L, HKV, D, CPU, 64, 0, str(tmp_path / "missing.safetensors"))
    (tmp_path / "junk.safetensors").write_text("not weights")
    with pytest.raises(ConfigError, match="not a safetensors file"):
        load_hash_weights(str(tmp_path / "junk.safetensors"), L, HKV, D, 64)


@pytest.mark.parametrize("cls", [CLO, RetroInfer])
def test_systems_run_with_learned_weights_and_refuse_bad_ones_before_allocating(cls, tmp_path):
    base = dict(sink=4, recent=8, topk_ratio=0.25, dense_layers=0, rbit=64)
    if cls is CLO:
        base.update(speculative=False, persistent=False)
    with pytest.raises(ConfigError, match="no such file"):
        cls(**base, hash_weights=str(tmp_path / "missing.safetensors"))
    exact = cls(**{**base, "retriever": "exact"}, hash_weights=str(tmp_path / "missing.safetensors"))
    exact.allocate(spec())  # the model's default weights are the hash retriever's: another ignores them
    assert exact.retriever.name == "exact"
    wrong = cls(**base, hash_weights=str(weights_file(tmp_path, (L, HKV, D + 1, 64), "d.safetensors")))
    with pytest.raises(ConfigError, match="another model"):
        wrong.estimate_memory(spec())  # the preflight's estimate: before any allocation
    s = cls(**base, hash_weights=str(weights_file(tmp_path)))
    s.allocate(spec())
    assert s.retriever.weights_source == "learned (w.safetensors)"
    if cls is CLO:  # (RetroInfer's decode compiles its numba LRU first: test_baselines runs it)
        feed(s)
        assert s.describe()["retriever"] == "learned (w.safetensors)"


def test_the_importance_proxy_and_its_file():
    keys = torch.randn(2, 100, 8)
    keys[:, 50] *= 0  # nothing special: the mass is a softmax's share, in [0, 1]
    q = torch.randn(5, 4, 8)
    m = middle_mass(keys, q, 16, 64)
    assert m.shape == (2,) and bool(((m >= 0) & (m <= 1)).all())
    scores, mass = importance([({0: keys}, {0: q}), ({0: keys}, {0: q})], 1, 16, 64)
    assert float(scores.max()) == 1.0 and torch.allclose(mass[0], m)
    s, desc = load_importance("data/head_importance/smollm2-proxy.tsv", 30, 3)
    assert s.shape == (30, 3) and float(s.max()) == pytest.approx(1.0, abs=1e-5) and float(s.min()) >= 0
    assert "proxy" in desc
    meta = json.loads((ROOT / "data" / "head_importance" / "smollm2-proxy.json").read_text())
    assert meta["model"] == "smollm2"


@pytest.mark.slow
def test_the_commands_write_their_files_on_a_tiny_model(tmp_path):
    """train_hata writes W and refuses to overwrite it; hata_recall scores it against SimHash and the exact top-k
    (a tiny random model stands in for the real weights, which the commands need)."""
    from hydra import compose, initialize_config_dir

    from experiments.producers import hata_recall, train_hata
    from plots.hata_readme import tables
    from tests.test_config import CONF
    from tests.test_reuse_profile import TINY, tiny_decode

    out = tmp_path / "w.safetensors"
    base = ["seqlen=1200", "workload.gen_tokens=6", "workload.stop_at_eos=false", "device=cpu", *TINY]
    with initialize_config_dir(str(CONF), version_base="1.3"):
        train = [f"+hata_out={out}", "+hata.rbit=16", "+hata.steps=3", "+hata.seeds=[1]"]
        unpaired = compose("config", overrides=[*base, *train])
        train = compose("config", overrides=[*base, *train, "+hata.depths=[0.5]"])
        recall = compose(
            "config",
            overrides=[
                *base,
                f"+recall.weights=[{out}]",
                "+recall.seeds=[2]",
                "+recall.depths=[0.3]",
                "+recall.random_prompt=false",
            ],
        )
    with pytest.raises(ConfigError, match="pair up"):
        train_hata.run(unpaired, tiny_decode)  # one seed, four depths
    record, path = train_hata.run(train, tiny_decode)
    assert path == out and record["shape"] == [3, 2, 16, 16]
    assert load_hash_weights(str(out), 3, 2, 16, 16)[0].shape == (3, 2, 16, 16)
    with pytest.raises(ConfigError, match="exists"):
        train_hata.run(train, tiny_decode)
    data = hata_recall.measure(recall, tiny_decode)
    rows = data["summary"]["needle_held_out"]
    assert set(rows) == {"exact", "learned_rbit16", "simhash_rbit16", "pq"} and rows["exact"]["recall"] == 1.0
    assert all(0 <= v["recall"] <= 1 and 0 <= v["mass"] <= 1 for v in rows.values())
    assert "learned - SimHash" in tables(data)
