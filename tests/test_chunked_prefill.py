"""Chunked prefill: a layer runs over the prompt a chunk of queries at a time, each chunk attending to
the keys up to its own end. It must give what the whole prompt at once gives: the logits of every position and
the K/V handed to the KV system, for chunk sizes that do and do not divide the prompt."""

import json

import pytest
import torch

from baselines.fullattn import FullAttn
from kvoffload.kv.interface import KVSpec
from kvoffload.model import chunk_attention
from kvoffload.model.chunk_attention import causal_attention, split_causal_attention
from kvoffload.model.config import ModelConfig
from kvoffload.model.weights import synthetic_decoder
from tests.tiny_models import tiny_config

CPU = torch.device("cpu")


def tiny(family: str = "llama", **kw) -> ModelConfig:
    shapes = dict(hidden_size=64, intermediate_size=160, num_layers=3, num_heads=8, num_kv_heads=2, head_dim=8)
    return tiny_config(
        name=f"tiny-{family}", family=family, vocab_size=97, max_position_embeddings=1024, **{**shapes, **kw}
    )


class Recorder(FullAttn):
    """FullAttn that keeps a copy of what each layer's prefill is handed."""

    def __init__(self):
        super().__init__()
        self.handed = {}

    def prefill(self, layer, k, v):
        self.handed[layer] = (k.clone(), v.clone())
        super().prefill(layer, k, v)


def recorder(cfg: ModelConfig, batch: int, max_len: int) -> Recorder:
    kv = Recorder()
    kv.allocate(
        KVSpec(cfg.num_layers, batch, max_len, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, torch.float32, CPU)
    )
    return kv


@torch.inference_mode()
def whole_prompt_prefill(model, tokens: torch.Tensor):
    """The reference: every layer over the whole prompt at once, the causal softmax written out (no SDPA, no
    chunks) -> (logits [B, T, V], [(k, v) per layer])."""
    t = tokens.shape[1]
    x = model.model.embed_tokens(tokens)
    cos, sin = model.rotary().cos_sin(torch.arange(t), x.dtype)
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    handed = []
    for layer in model.model.layers:
        attn = layer.self_attn
        q, k, v = attn.qkv(layer.input_layernorm(x), cos, sin)
        handed.append((k, v))
        g = attn.h // attn.hkv
        scores = q @ k.repeat_interleave(g, 1).transpose(-1, -2) / attn.d**0.5
        o = scores.masked_fill(future, float("-inf")).softmax(-1) @ v.repeat_interleave(g, 1)
        x = x + attn.o_proj(o.transpose(1, 2).flatten(2))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.model.norm(x)).float(), handed


def masked_softmax_attention(q, k, v, start):
    g = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(g, 1).transpose(-1, -2) / q.shape[-1] ** 0.5
    rows = torch.arange(start, start + q.shape[2])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[2])[None, :] > rows, float("-inf"))
    return scores.softmax(-1) @ v.repeat_interleave(g, 1)


@pytest.mark.parametrize("start,c", [(0, 5), (1, 5), (16, 16), (37, 11), (100, 1)])
@pytest.mark.parametrize("rows", [256, 3])  # 3: the masked path in blocks of query rows
def test_causal_attention_is_bottom_right_aligned(start, c, rows, monkeypatch):
    monkeypatch.setattr(chunk_attention, "MASKED_ROWS", rows)
    g = torch.Generator().manual_seed(start + c)
    q = torch.randn(2, 6, c, 16, generator=g)
    k, v = torch.randn(2, 3, start + c, 16, generator=g), torch.randn(2, 3, start + c, 16, generator=g)
    torch.testing.assert_close(causal_attention(q, k, v, start), masked_softmax_attention(q, k, v, start))


def math_attend(q, k, v, causal):
    """Attention with the log-sum-exp of each query's scaled scores: what the split path takes from cuDNN, in fp32,
    the output rounded to the inputs' dtype as cuDNN returns it."""
    g = q.shape[1] // k.shape[1]
    scores = q.float() @ k.float().repeat_interleave(g, 1).transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v.float().repeat_interleave(g, 1)).to(q.dtype), scores.logsumexp(-1)


@pytest.mark.parametrize("start,c", [(1, 5), (16, 16), (37, 11), (100, 1)])
def test_the_split_path_merges_the_keys_before_the_chunk_with_its_own(start, c):
    g = torch.Generator().manual_seed(start * c)
    q = torch.randn(2, 6, c, 16, generator=g)
    k, v = torch.randn(2, 3, start + c, 16, generator=g), torch.randn(2, 3, start + c, 16, generator=g)
    want = masked_softmax_attention(q, k, v, start)
    torch.testing.assert_close(split_causal_attention(q, k, v, start, math_attend), want)
    # in bf16 the merge runs in place on the rounded outputs: within a few of their rounding steps
    bf = [t.bfloat16() for t in (q, k, v)]
    got = split_causal_attention(*bf, start, math_attend).float()
    assert (got - masked_softmax_attention(*(t.float() for t in bf), start)).abs().max() < 3 * 2**-8


def test_the_last_chunk_row_sees_every_key_and_the_first_only_its_past():
    """A guard on the test above: with one key made huge and its value distinct, the query rows before it must not
    see it, the rows at or after it must."""
    start, c = 6, 4
    q = torch.ones(1, 2, c, 8)
    k, v = torch.zeros(1, 1, start + c, 8), torch.zeros(1, 1, start + c, 8)
    k[0, 0, start + 1], v[0, 0, start + 1] = 50.0, 1.0  # the second query of the chunk and later see it
    o = causal_attention(q, k, v, start)
    assert o[0, :, 0].abs().max() == 0 and torch.all(o[0, :, 1:] > 0.99)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
# 8 divides the 40-token prompt, 7 does not; 40, 4096: one; 1: a chunk a token (seconds: the full suite)
@pytest.mark.parametrize("chunk", [pytest.param(1, marks=pytest.mark.slow), 7, 8, 40, 4096])
def test_chunked_prefill_equals_the_whole_prompt(family, chunk):
    cfg = tiny(family)
    model = synthetic_decoder(cfg, 0, CPU, torch.float32)
    if family == "qwen2":  # nonzero q/k/v biases, so that they count
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.qkv_proj.bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    want_logits, want_kv = whole_prompt_prefill(model, tokens)
    model.prefill_chunk = chunk
    kv = recorder(cfg, 2, 48)
    got = model.prefill(tokens, kv, all_logits=True)
    torch.testing.assert_close(got, want_logits, atol=2e-5, rtol=1e-5)
    for layer, (k, v) in enumerate(want_kv):
        torch.testing.assert_close(kv.handed[layer][0], k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kv.handed[layer][1], v, atol=1e-5, rtol=1e-5)
    last = model.prefill(tokens, recorder(cfg, 2, 48))  # the last position's logits, the runner's path
    torch.testing.assert_close(last, want_logits[:, -1], atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_real_smollm2_chunked_prefill_equals_the_whole_prompt(smollm2_folder):
    from kvoffload.model.weights import hf_decoder

    cfg = ModelConfig.from_hf(json.loads((smollm2_folder / "config.json").read_text()), "smollm2")
    model = hf_decoder(cfg, smollm2_folder, CPU, torch.float32)
    tokens = torch.randint(0, cfg.vocab_size, (1, 48), generator=torch.Generator().manual_seed(5))
    want, _ = whole_prompt_prefill(model, tokens)
    for chunk in (16, 20):  # 16 divides the prompt, 20 does not
        model.prefill_chunk = chunk
        got = model.prefill(tokens, recorder(cfg, 1, 50), all_logits=True)
        assert (got - want).abs().max() < 1e-4 * want.abs().max(), chunk
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_kv_fill_hands_layer_zeros_kv_as_the_prefill_does():
    """Decoder.fill (workload.kv_fill=projection) gives every layer its own K/V projection of the embeddings: for
    layer 0, whose input is the embeddings, exactly what the prefill hands the system; other layers differ (no
    attention or MLP before them) but have the prompt's shape."""
    cfg = tiny()
    model = synthetic_decoder(cfg, 0, CPU, torch.float32)
    model.prefill_chunk = 48
    tokens = torch.randint(0, cfg.vocab_size, (2, 100), generator=torch.Generator().manual_seed(1))
    filled, prefilled = recorder(cfg, 2, 104), recorder(cfg, 2, 104)
    logits = model.fill(tokens, filled)
    model.prefill(tokens, prefilled)
    assert logits.shape == (2, cfg.vocab_size) and filled.length == prefilled.length == 100
    for a, b in zip(filled.handed[0], prefilled.handed[0], strict=True):
        torch.testing.assert_close(a, b)
    assert filled.handed[1][0].shape == prefilled.handed[1][0].shape
    assert not torch.allclose(filled.handed[1][0], prefilled.handed[1][0])
