"""experiments.producers.reuse_profile: the top-k overlap on hand-made sets, every metric recomputed from the recorded
queries with the tests' own reference top-k, and the command writing its file and refusing to overwrite it. A tiny
random model stands in for the real weights (the command itself refuses synthetic weights)."""

import json

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from experiments.producers.reuse_profile import METRICS, group_cosine, measure, run, topk_overlap
from experiments.runner import run_settings
from kvoffload.errors import ConfigError
from kvoffload.generate import generate
from kvoffload.kv.interface import KVSpec
from kvoffload.model.config import ModelConfig
from kvoffload.model.weights import synthetic_decoder
from kvoffload.offload.budget import select_budget
from kvoffload.paths import ROOT
from plots.reuse_profile_readme import readme
from tests.reference import topk_middle
from tests.test_config import CONF

TINY = [
    "model.name=tiny",
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.num_layers=3",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.head_dim=16",
    "model.vocab_size=256",
    "model.weights=synthetic",
    "workload.prompt=random",
]


def config(tmp_path, *overrides, out="reuse.json"):
    """The tiny model at 1200 tokens: the default budget selects k = 120 - 16 - 64 = 40 of 1120 middle tokens."""
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose(
            "config",
            overrides=[
                "seqlen=1200",
                "workload.gen_tokens=12",
                "workload.stop_at_eos=false",
                "device=cpu",
                f"+reuse_out={tmp_path / out}",
                *TINY,
                *overrides,
            ],
        )


def tiny_decode(cfg, make_kv, min_steps=3, keep=None):
    """experiments.producers.profile.decode_real with synthetic weights and a random prompt (what it refuses)."""
    model_cfg = ModelConfig.from_mapping(OmegaConf.to_container(cfg.model, resolve=True))
    seqlen, gen = run_settings.parse_tokens(cfg.seqlen), int(cfg.workload.gen_tokens)
    model = synthetic_decoder(model_cfg, int(cfg.seed), torch.device("cpu"), torch.float32)
    gen_ids = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model_cfg.vocab_size, (int(cfg.batch), seqlen), generator=gen_ids)
    kv = make_kv(model_cfg, seqlen)
    if keep is not None:
        kv.queries = [[] for _ in range(model_cfg.num_layers)]
        keep.append(kv)
    kv.allocate(
        KVSpec(
            model_cfg.num_layers,
            int(cfg.batch),
            seqlen + gen,
            model_cfg.num_heads,
            model_cfg.num_kv_heads,
            model_cfg.head_dim,
            torch.float32,
            torch.device("cpu"),
        )
    )
    generate(model, kv, prompt, gen)
    return model_cfg, kv, f"synthetic tiny; random prompt of {seqlen} tokens, {gen} greedy steps, batch {cfg.batch}"


def test_overlap_of_hand_made_sets():
    a = torch.tensor([[3, 7, 1, 9], [0, 1, 2, 3]])
    same = a.flip(-1)  # the same sets in another order
    disjoint = torch.tensor([[0, 2, 4, 5], [4, 5, 6, 7]])
    half = torch.tensor([[9, 3, 100, 50], [3, 2, 8, 9]])
    torch.testing.assert_close(topk_overlap(a, same), torch.ones(2))
    torch.testing.assert_close(topk_overlap(a, disjoint), torch.zeros(2))
    torch.testing.assert_close(topk_overlap(a, half), torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(topk_overlap(a[None], half[None]), torch.tensor([[0.5, 0.5]]))  # [B, Hkv, k]
    with pytest.raises(ValueError):
        topk_overlap(a, a[:, :2])


def test_group_cosine_is_the_group_mean():
    q = torch.randn(1, 4, 8)
    flip = q.clone()
    flip[:, :2] *= -1  # KV head 0's group points the other way
    torch.testing.assert_close(group_cosine(q, flip, 2), torch.tensor([[-1.0, 1.0]]))


@pytest.mark.slow
def test_metrics_match_a_reference_recomputation(tmp_path):
    cfg = config(tmp_path)
    kept = []
    rec = measure(cfg, lambda c, make_kv, min_steps: tiny_decode(c, make_kv, min_steps, kept))
    probe = kept[0]
    L, hkv, g, seqlen, sink, recent = 3, 2, 2, 1200, 16, 64
    k_sel = select_budget(seqlen, 0.1, sink, recent)
    assert k_sel == 40
    assert rec["budget"]["k"] == k_sel and rec["budget"]["middle_tokens"] == seqlen - sink - recent
    assert rec["decode_steps"] == 11  # the first of the 12 tokens comes from the prefill
    keys = [probe.exact.keys[layer][0] for layer in range(L)]  # [Hkv, T_mid, D], the middle of the prompt
    full = [torch.cat([torch.zeros(hkv, sink, 16), keys[layer], torch.zeros(hkv, recent, 16)], 1) for layer in range(L)]

    def ref_topk(layer, q):  # q [H, D] -> per KV head the set of middle tokens (absolute)
        return [
            set(topk_middle(q[h * g : (h + 1) * g], full[layer][h], sink, recent, k_sel).tolist()) for h in range(hkv)
        ]

    for layer in range(L):
        steps = probe.queries[layer]
        assert len(steps) == 11
        for lag in (1, 2, 4, 8):
            want_cos, want_ov = [], []
            for t in range(lag, len(steps)):
                q, qp = steps[t][0][0], steps[t - lag][0][0]
                want_cos.append(torch.nn.functional.cosine_similarity(q, qp, dim=-1).view(hkv, g).mean(-1))
                s, sp = ref_topk(layer, q), ref_topk(layer, qp)
                want_ov.append(torch.tensor([len(s[h] & sp[h]) / k_sel for h in range(hkv)]))
            got = rec["lags"]["query_cos"][str(lag)]["per_head_mean"][layer]
            torch.testing.assert_close(torch.tensor(got), torch.stack(want_cos).mean(0), atol=1e-4, rtol=0)
            got = rec["lags"]["topk_overlap"][str(lag)]["per_head_mean"][layer]
            torch.testing.assert_close(torch.tensor(got), torch.stack(want_ov).mean(0), atol=1e-4, rtol=0)
        if layer == 0:  # no speculative query for layer 0
            assert all(steps[t][1] is None for t in range(len(steps)))
            assert rec["metrics"]["spec_query_cos"]["per_head"]["mean"][0] == [None, None]
            assert rec["metrics"]["spec_topk_overlap"]["per_layer"]["mean"][0] is None
            continue
        cos = torch.stack(
            [torch.nn.functional.cosine_similarity(qs[0], q[0], dim=-1).view(hkv, g).mean(-1) for q, qs in steps]
        )
        ov = torch.stack(
            [
                torch.tensor([len(a & b) / k_sel for a, b in zip(ref_topk(layer, qs[0]), ref_topk(layer, q[0]))])
                for q, qs in steps
            ]
        )
        torch.testing.assert_close(
            torch.tensor(rec["metrics"]["spec_query_cos"]["per_head"]["mean"][layer]),
            cos.mean(0).float(),
            atol=1e-4,
            rtol=0,
        )
        torch.testing.assert_close(
            torch.tensor(rec["metrics"]["spec_topk_overlap"]["per_head"]["mean"][layer]),
            ov.mean(0).float(),
            atol=1e-4,
            rtol=0,
        )
        assert rec["metrics"]["spec_query_cos"]["per_layer"]["mean"][layer] == pytest.approx(
            float(cos.mean()), abs=1e-4
        )
        assert rec["metrics"]["spec_topk_overlap"]["per_layer"]["median"][layer] == pytest.approx(
            float(ov.flatten().median()), abs=1e-4
        )
        # a speculative query is another query: it differs from the real one
        assert cos.mean() < 0.9999
    for m in METRICS:
        for row in rec["metrics"][m]["per_head"]["mean"]:
            assert all(v is None or -1 - 1e-6 <= v <= 1 + 1e-6 for v in row)
    assert rec["s_hat"] == rec["metrics"]["query_cos"]["per_head"]["mean"]
    assert rec["metrics"]["query_cos"]["samples_per_head"] == 10
    assert rec["metrics"]["spec_topk_overlap"]["layers"] == [1, 2]


@pytest.mark.slow
def test_command_writes_its_file_and_refuses_to_overwrite(tmp_path):
    cfg = config(tmp_path)
    out = tmp_path / "reuse.json"
    data, path = run(cfg, tiny_decode)
    assert path == out and json.loads(out.read_text()) == json.loads(json.dumps(data, default=str))
    prov = data["provenance"]
    assert prov["prompt"]["tokens"] == 1200 and prov["prompt"]["resolved"] == "random"
    assert prov["greedy_tokens"] == 12 and prov["git"]["commit"]
    assert prov["command"].startswith("python -m experiments.producers.reuse_profile")
    before = out.read_text()
    with pytest.raises(ConfigError, match="force=true"):
        run(cfg, tiny_decode)
    assert out.read_text() == before
    cfg.force = True
    run(cfg, tiny_decode)
    assert json.loads(out.read_text())["experiment"] == "reuse_profile"


@pytest.mark.slow
def test_readme_from_the_record(tmp_path):
    data, path = run(config(tmp_path), tiny_decode)
    text = readme(json.loads(path.read_text()))
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split(" |")[0] for r in rows[-3:]] == ["| 0", "| 1", "| 2"]  # one row per layer
    assert rows[-3].count(" - / - ") == 2  # layer 0: no speculative query
    assert f"k = {data['budget']['k']} of" in text and data["provenance"]["command"] in text


def test_command_never_writes_the_tracked_profile(tmp_path):
    tracked = ROOT / "data/profiles/smollm2.json"  # tmp_path / an absolute path = the absolute path
    cfg = config(tmp_path, "model.name=smollm2", "force=true", out=tracked)
    with pytest.raises(ConfigError, match="tracked"):
        run(cfg, tiny_decode)


def test_command_refuses_synthetic_weights_and_unknown_budget_keys(tmp_path):
    with pytest.raises(ConfigError, match="real weights"):
        run(config(tmp_path))  # the real decode_real
    with pytest.raises(ConfigError, match="reuse.topk"):
        run(config(tmp_path, "+reuse.topk=3"), tiny_decode)
