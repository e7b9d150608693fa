"""The synthetic key process (workload.kv_fill=key_process): its keys have the geometry its profile asks for, the
fill with it is seeded and stays within the preflight's estimate, and bad input is refused before long work."""

import json

import pytest
import torch
from hydra import compose, initialize_config_dir

from baselines.fullattn import FullAttn
from experiments.runner import preflight
from experiments.runner.execute import execute
from experiments.workloads.key_process import FIELDS, KeyProcess, fit_fields, load_fields, resample_spectrum
from kvoffload.errors import ConfigError
from kvoffload.kv.interface import KVSpec
from kvoffload.model.weights import synthetic_decoder
from kvoffload.paths import ROOT
from tests.test_chunked_prefill import recorder, tiny
from tests.test_prefill_memory import CFG, measured

CPU = torch.device("cpu")


def fields(layers: int, kv_heads: int, d: int) -> dict:
    eig = 0.7 ** torch.arange(d, dtype=torch.float32)  # a steep spectrum
    energy = torch.arange(d, 0, -1, dtype=torch.float32) ** 2
    return {
        "mean_ratio": torch.linspace(0.3, 0.8, layers * kv_heads).view(layers, kv_heads),
        "key_rms": torch.full((layers, kv_heads), 2.0),
        "eig": (eig / eig.sum()).expand(layers, kv_heads, d).clone(),
        "query_energy": (energy / energy.sum()).expand(layers, kv_heads, d).clone(),
        "token_corr": torch.linspace(0.2, 0.7, layers * kv_heads).view(layers, kv_heads),
        "group_cos": torch.full((layers, kv_heads), 0.6),
    }


@pytest.mark.slow
def test_sampled_keys_have_the_profiles_geometry():
    f = fields(2, 2, 16)
    proc = KeyProcess(f, seed=3)
    # in chunks of 3000: the token chain runs on across them
    keys = torch.stack([proc.sample(i, 20000, CPU, torch.float32, chunk=3000) for i in range(2)])  # [L, Hkv, T, D]
    got, _ = fit_fields(keys, torch.randn(2, 2, 4, 2, 16))
    torch.testing.assert_close(got["mean_ratio"], f["mean_ratio"], atol=0.02, rtol=0)
    torch.testing.assert_close(got["key_rms"], f["key_rms"], atol=0, rtol=0.03)
    torch.testing.assert_close(got["eig"][..., 0], f["eig"][..., 0], atol=0, rtol=0.1)
    torch.testing.assert_close(got["token_corr"], f["token_corr"], atol=0.05, rtol=0)


def test_first_query_puts_its_energy_where_the_profile_says():
    f = fields(1, 2, 16)
    proc = KeyProcess(f, seed=0)
    torch.manual_seed(0)
    q0 = torch.randn(4000, 4, 16) * 5  # 4 query heads on 2 KV heads
    q = proc.first_query(0, q0)
    torch.testing.assert_close(q.norm(dim=-1), q0.norm(dim=-1))  # the model's norms kept
    basis = proc.basis[0].repeat_interleave(2, 0)  # [H, D, D]
    share = torch.einsum("bhd,hdi->bhi", q / q.norm(dim=-1, keepdim=True), basis).pow(2).mean(0)  # [H, D]
    # a little below the profile's share: normalising each draw shrinks its largest components most
    assert share[:, :4].sum(-1).min() > 0.8 * f["query_energy"][0, 0, :4].sum()
    assert share[:, :4].sum(-1).min() > 2 * 4 / 16  # far above an isotropic query's share
    u = q / q.norm(dim=-1, keepdim=True)
    pair = (u[:, 0] * u[:, 1]).sum(-1).mean()  # heads 0 and 1 share KV head 0
    assert abs(pair - 0.6) < 0.1 and abs((u[:, 1] * u[:, 2]).sum(-1).mean()) < 0.05


def test_spectrum_resampling_and_mapped_profiles(tmp_path):
    x = torch.tensor([0.5, 0.3, 0.2])
    torch.testing.assert_close(resample_spectrum(x, 6), torch.tensor([0.25, 0.25, 0.15, 0.15, 0.1, 0.1]))
    f = fields(3, 2, 4)
    src = tmp_path / "src.json"
    src.write_text(json.dumps({k: v.tolist() for k, v in f.items()}))
    mapped = tmp_path / "mapped.json"
    mapped.write_text(json.dumps({"from": str(src), "head_dim": 8, "source_head": [[5, 0, 1]] * 4}))
    out = load_fields(str(mapped))
    assert out["eig"].shape == (4, 3, 8) and out["mean_ratio"].shape == (4, 3)
    torch.testing.assert_close(out["eig"].sum(-1), torch.ones(4, 3))
    assert out["mean_ratio"][2, 0] == f["mean_ratio"][2, 1] and out["token_corr"][0, 1] == f["token_corr"][0, 0]
    mapped.write_text(json.dumps({"from": str(src), "head_dim": 8, "source_head": [[6]]}))
    with pytest.raises(ConfigError, match="out of range"):
        load_fields(str(mapped))


def test_the_fill_is_seeded_and_keeps_the_projection_values():
    cfg = tiny()
    model = synthetic_decoder(cfg, 0, CPU, torch.float32)
    model.prefill_chunk = 40
    tokens = torch.randint(0, cfg.vocab_size, (2, 100), generator=torch.Generator().manual_seed(1))
    plain = recorder(cfg, 2, 104)
    model.fill(tokens, plain)
    runs = []
    for seed in (7, 7, 8):
        model.key_process = KeyProcess(fields(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim), seed)
        runs.append(recorder(cfg, 2, 104))
        model.fill(tokens, runs[-1])
    for layer in range(cfg.num_layers):
        assert torch.equal(runs[0].handed[layer][0], runs[1].handed[layer][0])
        assert not torch.equal(runs[0].handed[layer][0], runs[2].handed[layer][0])
        torch.testing.assert_close(runs[0].handed[layer][1], plain.handed[layer][1])  # values: the projection's
    a, b = runs[0].handed[0][0]  # two sequences of one batch: their own keys
    assert not torch.equal(a, b)


def test_the_fill_stays_within_its_estimate():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = synthetic_decoder(CFG, 0, CPU, torch.float32)
        model.prefill_chunk = 256
        model.key_process = KeyProcess(fields(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim), 0)
        system = FullAttn()
        system.allocate(KVSpec(CFG.num_layers, 2, 2056, 4, 2, 64, torch.float32, CPU, prompt_len=2048))
        tokens = torch.randint(0, CFG.vocab_size, (2, 2048), generator=torch.Generator().manual_seed(0))
        peak, _ = measured(lambda: model.fill(tokens, system))
    finally:
        torch.set_num_threads(n)
    assert peak <= preflight.fill_peak_bytes(CFG, 2048, 2, 4, 256)


def composed(*overrides):
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        return compose("config", overrides=["wandb.enabled=false", "device=cpu", *overrides])


@pytest.mark.slow
def test_profile_files_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        KeyProcess.from_profile(str(tmp_path / "none.json"), 30, 3, 64, 0)
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({k: v.tolist() for k, v in fields(30, 3, 64).items()}))
    KeyProcess.from_profile(str(path), 30, 3, 64, 0)  # the right shape loads
    with pytest.raises(ConfigError, match=r"mean_ratio has shape \(30, 3\), the model needs \(32, 8\)"):
        KeyProcess.from_profile(str(path), 32, 8, 128, 0)
    with pytest.raises(ConfigError, match=r"eig has shape \(30, 3, 64\), the model needs \(30, 3, 128\)"):
        KeyProcess.from_profile(str(path), 30, 3, 128, 0)
    path.write_text(json.dumps({k: v.tolist() for k, v in fields(30, 3, 64).items() if k != FIELDS[0]}))
    with pytest.raises(ConfigError, match="no mean_ratio"):
        KeyProcess.from_profile(str(path), 30, 3, 64, 0)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["workload.kv_fill=key_process"], "is for synthetic weights"),  # real SmolLM2 weights
        (
            ["workload.kv_fill=key_process", "model.weights=synthetic", "model.synthetic_keys=data/profiles/x.json"],
            "no such file",
        ),
        (
            [
                "workload.kv_fill=key_process",
                "model.weights=synthetic",
                "model.synthetic_keys=data/profiles/llama3-keys-from-smollm2.json",
            ],
            "the model needs",
        ),
    ],
)
def test_a_run_refuses_bad_key_input_before_loading(overrides, message, monkeypatch):
    def no_weights(*a, **k):
        raise AssertionError("weights loaded before the refusal")

    monkeypatch.setattr("experiments.runner.execute.build_decoder", no_weights)
    with pytest.raises(ConfigError, match=message):
        execute(composed("seqlen=1024", *overrides), "fullattn")


def test_committed_key_profiles_fit_their_models():
    for model in ("smollm2", "llama3", "qwen25"):
        c = composed(f"model={model}").model
        f = load_fields(c.synthetic_keys)
        assert f["eig"].shape == (c.num_layers, c.num_kv_heads, c.head_dim)
        assert f["token_corr"].shape == (c.num_layers, c.num_kv_heads)
