"""CLO's sparse layers run as a decode step runs them (prepare the next layer, decode this one, then the dense
work), captured in one graph, with every cached head forced to miss or to hit: bench_clo_layer's pipeline."""

from __future__ import annotations

from dataclasses import replace
from unittest.mock import patch  # a setting changed for one block, restored after

import torch

from clo.config import PERSIST_QUERIES
from clo.system import CLO
from experiments.bench.common import DEV, LLAMA3
from experiments.runner.timing import dense_work, replay_ms
from kvoffload.model.decoder import Layer

CASES = {"all_miss": 2.0, "all_hit": -2.0}  # the threshold that forces every cached head to miss / to hit


def forced(stores, case: str, fn):
    """fn() with every cached head of the layers' stores (one, or a list) forced to miss or to hit (filled slots,
    threshold of CASES)."""
    stores = stores if isinstance(stores, list) else [stores]
    taus = [st.tau.clone() for st in stores]
    for st in stores:
        st.tau.fill_(CASES[case])
        st.valid.fill_(True)
    try:
        return fn()
    finally:
        for st, tau in zip(stores, taus):
            st.tau.copy_(tau)


def pipeline_us(clo: CLO, dense_step, layers: list[int], stream: torch.cuda.Stream | None = None) -> float:
    """Per-layer µs of consecutive sparse layers run as a decode step runs them: prepare(l + 1) (side and copy
    streams), decode(l) (waits for l's rows, attends), then the dense work; all in one graph. The marginal time
    per layer between all of `layers` and their first half, so that the first layer's exposed prepare cancels."""
    n = len(layers)
    full, half = (
        replay_ms(pipeline_step(clo, dense_step, layers[:m]), reps=5, stream=stream) * 1e3 for m in (n, n // 2)
    )
    return round((full - half) / (n - n // 2), 1)


def pipeline_step(clo: CLO, dense_step, layers: list[int]):
    """A closure running `layers` in a decode step's order (pipeline_us)."""
    q = torch.randn(1, LLAMA3.num_heads, LLAMA3.head_dim, dtype=torch.bfloat16, device=DEV)
    k, v = (torch.randn(1, LLAMA3.num_kv_heads, LLAMA3.head_dim, dtype=torch.bfloat16, device=DEV) for _ in "kv")

    def step():
        clo.prepare(layers[0], q)  # what the layer before does
        for i, layer in enumerate(layers):
            if i + 1 < len(layers):
                clo.prepare(layers[i + 1], q)
            clo.decode(layer, q, k, v)
            dense_step()

    return step


def pipeline_variants(clo: CLO, dense: Layer, layers: list[int]) -> dict:
    """The pipeline (pipeline_us) for each persist_query as the runner runs it (the step captured on a stream at
    the highest priority, CLO's attention stream too; kernel nodes keep their stream's priority in a graph:
    PyTorch instantiates with cudaGraphInstantiateFlagUseNodePriority), again with every stream at the default
    priority (the runner before it set them), and the dense work alone. (Tried before, no gain: the side and
    copy streams at the highest priority, an SM carveout of the GEMVs, and the dense work waiting for the next
    layer's selection; results/LEDGER.md.)"""
    stores = [clo.stores[i] for i in layers]
    dense_step = dense_work(dense, 1, True)
    out = {"dense": round(replay_ms(dense_step, reps=10) * 1e3, 1)}

    def sweep(tag: str = "", stream: torch.cuda.Stream | None = None) -> None:  # as out["<mode><tag>_<case>"]
        for mode in PERSIST_QUERIES:
            with patch.object(clo, "cfg", replace(clo.cfg, persist_query=mode)):
                for case in CASES:
                    out[f"{mode}{tag}_{case}"] = forced(
                        stores, case, lambda: pipeline_us(clo, dense_step, layers, stream)
                    )

    sweep()
    with patch.object(clo, "attn_stream", torch.cuda.Stream(DEV)):
        sweep("_default_priority", torch.cuda.Stream(DEV))
    return out
