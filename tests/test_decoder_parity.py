"""Our decoder against transformers' reference implementations: random small configs of both families (with
Llama-3 rope scaling), and the real SmolLM2 weights; greedy decoding through FullAttn against generate()."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from baselines.fullattn import FullAttn
from kvoffload.generate import generate
from kvoffload.kv.interface import KVSpec
from kvoffload.model.config import ModelConfig
from kvoffload.model.decoder import Decoder
from kvoffload.model.weights import hf_decoder

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=300,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
)


def fullattn(cfg: ModelConfig, batch: int, max_len: int, dtype=torch.float32) -> FullAttn:
    kv = FullAttn()
    kv.allocate(
        KVSpec(
            cfg.num_layers, batch, max_len, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dtype, torch.device("cpu")
        )
    )
    return kv


def ours_from(ref, name: str) -> Decoder:
    cfg = ModelConfig.from_hf(ref.config.to_dict(), name)
    model = Decoder(cfg)
    model.load_state_dict(ref.state_dict(), strict=False)
    return model.eval()


def check_prefill_and_decode(ref, ours: Decoder, seq: int = 40, batch: int = 2, atol: float = 2e-4):
    ids = torch.randint(0, ours.cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids).logits
    kv = fullattn(ours.cfg, batch, seq)
    got_prefill = ours.prefill(ids[:, : seq - 8], kv, all_logits=True)
    torch.testing.assert_close(got_prefill, want[:, : seq - 8], atol=atol, rtol=1e-4)
    for t in range(seq - 8, seq):  # the remaining tokens one decode step each
        kv.begin_step()
        got = ours.decode(ids[:, t], kv.position, kv)
        kv.end_step()
        torch.testing.assert_close(got, want[:, t], atol=atol, rtol=1e-4)


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ],
)
@pytest.mark.parametrize("chunk", [8192, 7])  # 7: the prompt's projections and norms in chunks, as at 512K
def test_llama_random_matches_transformers(rope_scaling, chunk, monkeypatch):
    monkeypatch.setattr("kvoffload.model.decoder.PREFILL_CHUNK", chunk)
    torch.manual_seed(0)
    hf_cfg = LlamaConfig(**SMALL, rope_theta=500000.0, rope_scaling=rope_scaling)
    ref = LlamaForCausalLM(hf_cfg).eval()
    ours = ours_from(ref, "tiny-llama")
    assert (ours.cfg.rope_scaling is not None) == (rope_scaling is not None)
    check_prefill_and_decode(ref, ours)


def test_qwen2_random_matches_transformers():
    torch.manual_seed(1)
    ref = Qwen2ForCausalLM(Qwen2Config(**SMALL, rope_theta=1e6)).eval()
    with torch.no_grad():  # random-init biases are zero in transformers: make them count
        for layer in ref.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    ours = ours_from(ref, "tiny-qwen2")
    assert ours.cfg.attention_bias
    check_prefill_and_decode(ref, ours)


def test_llama3_scaling_changes_frequencies():
    """Guards the rope-scaling test above against a scaling that does nothing."""
    from kvoffload.model.rope import inverse_frequencies

    base = ModelConfig.from_hf({**SMALL, "rope_theta": 500000.0})
    scaled = ModelConfig.from_hf(
        {
            **SMALL,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        }
    )
    assert not torch.allclose(inverse_frequencies(base), inverse_frequencies(scaled))


def real_models(folder, dtype):
    cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()), "smollm2")
    ours = hf_decoder(cfg, folder, torch.device("cpu"), dtype)
    ref = LlamaForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    return ours, ref


@pytest.mark.slow
def test_real_smollm2_logits_match_transformers(smollm2_folder):
    ours, ref = real_models(smollm2_folder, torch.float32)
    check_prefill_and_decode(ref, ours, seq=64, batch=1, atol=1e-3)


@pytest.mark.slow
def test_real_smollm2_bf16_logits_close(smollm2_folder):
    ours, ref = real_models(smollm2_folder, torch.bfloat16)
    ids = torch.randint(0, ours.cfg.vocab_size, (1, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(ids).logits.float()
    got = ours.prefill(ids, fullattn(ours.cfg, 1, 48, torch.bfloat16), all_logits=True)
    # bf16 keeps 8 mantissa bits; over 30 layers the two implementations round differently
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.95


@pytest.mark.slow
def test_real_smollm2_greedy_matches_generate(smollm2_folder):
    from transformers import AutoTokenizer

    ours, ref = real_models(smollm2_folder, torch.float32)
    tok = AutoTokenizer.from_pretrained(str(smollm2_folder))
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Name three primary colours."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    n = 24
    want = ref.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, min_new_tokens=n)[0, ids.shape[1] :]
    got = generate(ours, fullattn(ours.cfg, 1, ids.shape[1] + n), ids, n).tokens[0]
    assert got.tolist() == want.tolist(), (tok.decode(got), tok.decode(want))


def test_hf_projections_fuse_in_order_and_incomplete_groups_stay():
    from kvoffload.model.decoder import fuse_hf_state

    p = "model.layers.2."
    state = {
        p + "self_attn.q_proj.weight": torch.full((4, 3), 1.0),
        p + "self_attn.k_proj.weight": torch.full((2, 3), 2.0),
        p + "self_attn.v_proj.weight": torch.full((2, 3), 3.0),
        p + "self_attn.q_proj.bias": torch.ones(4),
        p + "self_attn.k_proj.bias": torch.ones(2),
        p + "self_attn.v_proj.bias": torch.ones(2),
        p + "mlp.gate_proj.weight": torch.zeros(5, 3),
    }  # no up_proj: left for load_state_dict to report
    fused = fuse_hf_state(dict(state))
    assert fused[p + "self_attn.qkv_proj.weight"][:, 0].tolist() == [1.0] * 4 + [2.0] * 2 + [3.0] * 2
    assert fused[p + "self_attn.qkv_proj.bias"].shape == (8,)
    assert p + "mlp.gate_proj.weight" in fused and p + "mlp.gate_up_proj.weight" not in fused
    assert not any(".q_proj." in k or ".k_proj." in k or ".v_proj." in k for k in fused)


def test_smollm2_folder_converted_once_by_concurrent_first_users(tmp_path, monkeypatch):
    """Two sweeps started at once on a fresh machine both find the folder missing: one converts, the other waits
    for it (the second used to fail on the first's temporary folder)."""
    import threading
    import time

    from kvoffload.model import gguf_convert, weights

    calls = []

    def convert(gguf_path, out):
        calls.append(out)
        time.sleep(0.2)  # both threads are past the first check before the folder exists
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setenv("CLO_CACHE", str(tmp_path))
    monkeypatch.setattr(gguf_convert, "gguf_to_hf_folder", convert)
    monkeypatch.setattr(weights, "smollm2_gguf_path", lambda: tmp_path / "x.gguf")
    got = []
    threads = [threading.Thread(target=lambda: got.append(weights.smollm2_folder())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(got) == 2 and got[0] == got[1] == calls[0]
