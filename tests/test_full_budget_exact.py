"""Correctness first, at every prompt length: middles (prompt - sink - recent) that are and are
not a multiple of the block size, shorter than a block, and empty.
  (a) top-k 100 % is FullAttn, for every offloading baseline (RetroInfer-style, block and token selection, with
      the hash, exact, wave and pq retrievers; InfiniGen-style, speculative and oracle;
      PQCache-style, PQ and exact), on random inputs through the
      KVOffloadSystem API and on real SmolLM2 weights through the decoder;
  (b) RetroInfer-style with the exact retriever attends exactly the top-k tokens (token selection) or the top
      blocks, a partial last block included (block selection), of the same budget, with a cache as large as
      every block and with the smallest one."""

import math

import pytest
import torch

from baselines.fullattn import FullAttn
from baselines.infinigen import InfiniGen
from baselines.pqcache import PQCache
from baselines.retroinfer import RetroInfer
from kvoffload.kv.interface import KVSpec
from kvoffload.offload.budget import select_budget, split_prompt
from tests.reference import exact_topk_attention

B, H, HKV, D, L, STEPS = 2, 8, 2, 16, 3, 3
SINK, RECENT, BS = 4, 8, 8
CPU = torch.device("cpu")
# middles of 0 (a prompt shorter than sink + recent, and one exactly as long), 3 (shorter than a block), 8 and 16
# (whole blocks), 13, 21 and 111 (a partial last block)
PROMPTS = [7, 12, 15, 20, 25, 28, 33, 123]

SYSTEMS = {
    "retro-block-hash": (RetroInfer, {}),
    "retro-block-exact": (RetroInfer, {"retriever": "exact"}),
    "retro-block-wave": (RetroInfer, {"retriever": "wave", "wave_segment": 40}),  # with its estimation zone
    "retro-block-wave-noest": (RetroInfer, {"retriever": "wave", "wave_segment": 40, "wave_estimate": 0}),
    "retro-block5-exact-cache1": (RetroInfer, {"retriever": "exact", "block_size": 5, "cache_multiple": 1.0}),
    "retro-token-hash": (RetroInfer, {"selection": "token"}),
    "retro-token-exact": (RetroInfer, {"selection": "token", "retriever": "exact"}),
    "retro-token-wave": (RetroInfer, {"selection": "token", "retriever": "wave", "wave_segment": 40}),
    "retro-block-pq": (RetroInfer, {"retriever": "pq"}),
    "retro-token-pq": (RetroInfer, {"selection": "token", "retriever": "pq"}),
    "infinigen": (InfiniGen, {}),
    "infinigen-oracle": (InfiniGen, {"oracle_query": True}),
    "pqcache": (PQCache, {"block_size": 8, "cache_tokens": 16}),
    "pqcache-exact": (PQCache, {"retriever": "exact", "block_size": 5, "cache_tokens": 1000}),
}


def make(cls, t0, **kw):
    base = {"sink": SINK, "recent": RECENT, "topk_ratio": 1.0, "dense_layers": 1, "cpu_threads": 2}
    s = FullAttn() if cls is FullAttn else cls(**{**base, **kw})
    s.allocate(KVSpec(L, B, t0 + STEPS, H, HKV, D, torch.float32, CPU, prompt_len=t0))
    return s


def inputs(t0, seed=0):
    g = torch.Generator().manual_seed(seed)
    k0, v0 = torch.randn(L, B, HKV, t0, D, generator=g), torch.randn(L, B, HKV, t0, D, generator=g)
    data = [
        [
            (
                torch.randn(B, H, D, generator=g),
                torch.randn(B, HKV, D, generator=g),
                torch.randn(B, HKV, D, generator=g),
            )
            for _ in range(L)
        ]
        for _ in range(STEPS)
    ]
    return k0, v0, data


def feed(system, k0, v0, data):
    """The inputs through the API (the speculative call one layer ahead with the next layer's real query, as
    the decoder's); per step the outputs of every layer."""
    t0 = k0.shape[3]
    for layer in range(L):
        system.prefill(layer, k0[layer], v0[layer])
    system.end_prefill(t0)
    outs = []
    for step in data:
        system.begin_step()
        row = []
        for layer in range(L):
            if system.wants_speculative_query and layer + 1 < L:
                system.prepare(layer + 1, step[layer + 1][0])
            row.append(system.decode(layer, *step[layer]))
        outs.append(row)
        system.end_step()
    return outs


def assert_outputs(got, want):
    for s, (g_row, w_row) in enumerate(zip(got, want)):
        for layer, (g, w) in enumerate(zip(g_row, w_row)):
            torch.testing.assert_close(
                g, w, atol=1e-5, rtol=1e-4, msg=lambda m, s=s, layer=layer: f"step {s} layer {layer}: {m}"
            )


@pytest.mark.parametrize("t0", PROMPTS)
@pytest.mark.parametrize("name", SYSTEMS)
def test_full_topk_equals_fullattn(name, t0):
    cls, kw = SYSTEMS[name]
    k0, v0, data = inputs(t0)
    s = make(cls, t0, **kw)
    n_mid = split_prompt(t0, SINK, RECENT)[2]
    assert s.k_select(t0) >= n_mid  # the whole middle is retrieved
    assert_outputs(feed(s, k0, v0, data), feed(make(FullAttn, t0), k0, v0, data))


BUDGETS = {"third": lambda n: n // 3, "half+1": lambda n: n // 2 + 1, "all-but-one": lambda n: n - 1}


@pytest.mark.parametrize("cache_multiple", [1000.0, 1.0])  # every block fits | the smallest cache
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("t0", [20, 25, 33, 123, 128])  # middles 8, 13, 21, 111, 116
@pytest.mark.parametrize("selection", ["token", "block"])
def test_exact_retriever_attends_the_exact_topk_of_the_budget(selection, t0, budget, cache_multiple):
    n_mid = split_prompt(t0, SINK, RECENT)[2]
    k = BUDGETS[budget](n_mid)
    ratio = (SINK + RECENT + k - 0.5) / t0  # ceil(ratio * t0) = sink + recent + k
    assert select_budget(t0, ratio, SINK, RECENT) == k
    s = make(RetroInfer, t0, retriever="exact", selection=selection, cache_multiple=cache_multiple, topk_ratio=ratio)
    k0, v0, data = inputs(t0, seed=t0)
    if selection == "token":
        assert s.k_select(t0) == k
        want = exact_topk_attention(k0, v0, data, SINK, RECENT, k, dense_layers=1)
    else:  # the budget rule of RetroInfer.k_select: floor(k / block_size) blocks, every block when k = n_mid
        blocks = math.ceil(n_mid / BS) if k == n_mid else k // BS
        assert s.k_select(t0) == blocks * BS
        want = exact_topk_attention(k0, v0, data, SINK, RECENT, blocks, dense_layers=1, block_size=BS)
    if cache_multiple > 10 and s.k_select(t0):
        assert s.geometry(t0)[2] == s.geometry(t0)[0]  # the cache holds every block
    assert_outputs(feed(s, k0, v0, data), want)


def test_block_selection_picks_the_partial_last_block_by_its_real_tokens():
    """A query that only the last, partial block's real tokens match: block selection at one block attends that
    block (its padding rows, zeros in the host store, are neither scored nor attended)."""
    t0 = 25  # middle 13: blocks [0, 8) and [8, 13) + 3 padding rows
    s = make(RetroInfer, t0, retriever="exact", topk_ratio=(SINK + RECENT + 8) / t0, dense_layers=0)
    assert s.k_select(t0) == BS
    k0, v0, data = inputs(t0, seed=1)
    k0[:, :, :, SINK : SINK + 8] = -k0[:, :, :, SINK : SINK + 8].abs()  # first block: negative keys
    k0[:, :, :, SINK + 8 : SINK + 13] = k0[:, :, :, SINK + 8 : SINK + 13].abs()  # partial block: positive
    data = [[(q.abs(), k, v) for q, k, v in step] for step in data]  # positive queries
    want = exact_topk_attention(k0, v0, data, SINK, RECENT, 1, block_size=BS)
    assert_outputs(feed(s, k0, v0, data), want)


# ---- real SmolLM2 weights through the decoder -------------------------------------------------------------
REAL_SYSTEMS = {
    "retroinfer-block-hash": ("retroinfer", []),  # the default
    "retroinfer-block-wave": ("retroinfer", ["system.retriever=wave"]),
    "retroinfer-token-hash": ("retroinfer", ["system.selection=token"]),
    "infinigen": ("infinigen", []),  # the offline skew
}
REAL_STEPS = 6


@pytest.fixture(scope="module")
def smollm2(smollm2_folder):
    from hydra import compose, initialize_config_dir
    from transformers import AutoTokenizer

    from kvoffload.model.config import ModelConfig
    from kvoffload.model.weights import hf_decoder
    from tests.test_config import CONF

    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["system=fullattn"])
    mcfg = ModelConfig.from_mapping(cfg.model)
    return (
        mcfg,
        hf_decoder(mcfg, smollm2_folder, CPU, torch.float32),
        AutoTokenizer.from_pretrained(str(smollm2_folder)),
    )


def greedy_logits(model, mcfg, system, prompt):
    """Prefill, then REAL_STEPS greedy decode steps: the logits of every step [steps + 1, V]."""
    system.allocate(
        KVSpec(
            mcfg.num_layers,
            1,
            prompt.shape[1] + REAL_STEPS,
            mcfg.num_heads,
            mcfg.num_kv_heads,
            mcfg.head_dim,
            torch.float32,
            CPU,
            prompt_len=prompt.shape[1],
        )
    )
    with torch.inference_mode():
        logits = [model.prefill(prompt, system)]
        for _ in range(REAL_STEPS):
            system.begin_step()
            logits.append(model.decode(logits[-1].argmax(-1), system.position, system))
            system.end_step()
    return torch.cat(logits)


@pytest.mark.slow
@pytest.mark.parametrize("t0", [880, 883])  # SmolLM2's sink 16 + recent 64: middles 800 (100 blocks), 803
def test_real_smollm2_full_topk_logits_equal_fullattn(smollm2, t0):
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from experiments.workloads.prompts import build_prompt
    from tests.test_config import CONF

    mcfg, model, tok = smollm2
    prompt = build_prompt("needle", t0, 1, 0, tok).tokens
    want = greedy_logits(model, mcfg, FullAttn(), prompt)
    for name, (system, overrides) in REAL_SYSTEMS.items():
        with initialize_config_dir(str(CONF), version_base="1.3"):
            cfg = compose("config", overrides=[f"system={system}", "system.topk_ratio=1.0", *overrides])
        got = greedy_logits(model, mcfg, instantiate(cfg.system), prompt)
        assert torch.equal(got.argmax(-1), want.argmax(-1)), name  # the same greedy tokens
        torch.testing.assert_close(got, want, atol=5e-4, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
