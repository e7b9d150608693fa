"""CLO inside the decoder: the speculative one-layer-ahead path, persistent heads and dense layers together;
with real SmolLM2 weights, the same greedy answer as FullAttn on the default needle prompt."""

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from baselines.fullattn import FullAttn
from clo.system import CLO
from kvoffload.generate import generate
from kvoffload.kv.interface import KVSpec
from kvoffload.model.config import ModelConfig
from kvoffload.model.weights import hf_decoder, synthetic_decoder
from tests.reference import write_profile
from tests.test_config import CONF
from tests.tiny_models import tiny_config

CPU = torch.device("cpu")


def run(model, system, prompt, n, stop=frozenset()):
    cfg = model.cfg
    system.allocate(
        KVSpec(
            cfg.num_layers,
            prompt.shape[0],
            prompt.shape[1] + n,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            torch.float32,
            CPU,
        )
    )
    return generate(model, system, prompt, n, stop)


@pytest.mark.slow
def test_full_budget_clo_generates_fullattn_tokens_with_every_part_on(tmp_path):
    cfg = tiny_config(
        hidden_size=128, intermediate_size=256, num_layers=5, num_heads=8, vocab_size=500, max_position_embeddings=2048
    )
    model = synthetic_decoder(cfg, 0, CPU, torch.float32)
    prompt = torch.randint(0, 500, (2, 300), generator=torch.Generator().manual_seed(0))
    # a profile that makes some heads hard: persistent heads and prefetch heads both exist
    s_hat = torch.full((5, 2), 0.95)
    s_hat[2:] = 0.1  # both KV heads of layers 2-4 are hard
    profile = write_profile(tmp_path / "tiny.json", s_hat.tolist())
    # N_p = floor(1 ms x 0.1 GB/s / (2 seqs x 300 rows x 128 B)) = 1: one prefetch head, one persistent
    clo = CLO(topk_ratio=1.0, sink=4, recent=8, profile=profile, layer_time_ms=1.0, link_gb_s=0.1)
    got = run(model, clo, prompt, 12)
    assert clo.plan.heads.n_p == 1 and clo.wants_speculative_query
    assert sum(map(len, clo.plan.heads.persistent)) == 3 and sum(map(len, clo.plan.heads.prefetch)) == 3
    want = run(model, FullAttn(), prompt, 12)
    assert torch.equal(got.tokens, want.tokens)


@pytest.mark.slow
# the default CLO (on CPU its measured link leaves every hard head to prefetch), and a near-zero link, which makes
# every hard head persistent, selecting with either query
@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["system.link_gb_s=1e-6", "system.persist_query=real"],
        ["system.link_gb_s=1e-6", "system.persist_query=speculative"],
    ],
)
def test_real_smollm2_needle_answer_equals_fullattn(smollm2_folder, overrides):
    from transformers import AutoTokenizer

    from experiments.workloads.prompts import build_prompt

    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["system=clo", *overrides])
    mcfg = ModelConfig.from_mapping(cfg.model)
    model = hf_decoder(mcfg, smollm2_folder, CPU, torch.float32)
    tok = AutoTokenizer.from_pretrained(str(smollm2_folder))
    prompt = build_prompt("needle", 3072, 1, 0, tok)
    stop = {tok.eos_token_id}
    clo = instantiate(cfg.system)  # the default CLO: top-k 10 %, hash retrieval, SmolLM2 profile, speculation
    got = run(model, clo, prompt.tokens, 24, stop)
    want = run(model, FullAttn(), prompt.tokens, 24, stop)
    text = tok.decode(got.tokens[0], skip_special_tokens=True)
    assert text == tok.decode(want.tokens[0], skip_special_tokens=True) and prompt.answer in text
    hits = sum(s.hits for s in got.steps) / sum(s.lookups for s in got.steps)
    assert 0 < hits < 1  # the cache was really used, and really missed
    assert (clo.plan.heads.summary()["persistent_heads"] > 0) == bool(overrides)
