"""The small CPU case the RetroInfer- and InfiniGen-style baseline tests share (tests/test_baselines.py,
test_baselines_lru.py, test_baselines_memory.py, test_hata.py): its shapes, a system allocated for it, random
prompt and decode inputs fed through the KVOffloadSystem API, and exact top-k attention over them."""

import math

import torch

from kvoffload.kv.interface import KVSpec
from tests.reference import exact_topk_attention, topk_middle

B, H, HKV, D, L, T0, STEPS = 2, 8, 2, 16, 3, 123, 4  # T0 - sink - recent = 111: a partial last block
G = H // HKV
SINK, RECENT, RATIO = 4, 8, 0.25
K_SEL = math.ceil(RATIO * T0) - SINK - RECENT
CPU = torch.device("cpu")


def spec(budget=None):
    return KVSpec(L, B, T0 + STEPS, H, HKV, D, torch.float32, CPU, budget)


def make(cls, **kw):
    s = cls(**{**dict(sink=SINK, recent=RECENT, topk_ratio=RATIO, dense_layers=0, cpu_threads=2), **kw})
    s.allocate(spec())
    return s


def feed(system, seed=0, speculate_with_true_query=False):
    """Random prompt and decode inputs through the API; per step the outputs of every layer, and the data."""
    g = torch.Generator().manual_seed(seed)
    k0, v0 = torch.randn(L, B, HKV, T0, D, generator=g), torch.randn(L, B, HKV, T0, D, generator=g)
    for layer in range(L):
        system.prefill(layer, k0[layer], v0[layer])
    system.end_prefill(T0)
    outs, data, stats = [], [], []
    for _ in range(STEPS):
        step = [
            (
                torch.randn(B, H, D, generator=g),
                torch.randn(B, HKV, D, generator=g),
                torch.randn(B, HKV, D, generator=g),
            )
            for _ in range(L)
        ]
        data.append(step)
        system.begin_step()
        row = []
        for layer in range(L):
            if speculate_with_true_query and layer + 1 < L:
                system.prepare(layer + 1, step[layer + 1][0])  # the model's one-layer-ahead call, exact query
            row.append(system.decode(layer, *step[layer]))
        outs.append(row)
        stats.append(system.end_step())
    return outs, (k0, v0, data), stats


def exact_topk(q, keys):
    return topk_middle(q, keys, SINK, RECENT, K_SEL)


def reference(k0, v0, data, dense_layers=0):
    return exact_topk_attention(k0, v0, data, SINK, RECENT, K_SEL, dense_layers)


def assert_outputs(got, want):
    for s in range(STEPS):
        for layer in range(L):
            torch.testing.assert_close(got[s][layer], want[s][layer], atol=1e-5, rtol=1e-4)
