"""Piecewise CUDA graphs (vLLM's term) for systems whose decode step cannot be captured whole, because they talk to the
host inside it (RetroInfer's CPU LRU, InfiniGen's CPU gather). The model's dense work between two attention calls, which
touches no KV system, is captured once per layer and replayed (with the synthetic query process's kernels, when a
workload has one: they are the workload's, and a graph-captured system pays them replayed too); only the system's own
prepare() and decode() run eagerly. Every system then pays the same graph-replayed cost for the projections and the MLP,
and an eager step's time is the system's, not that of the dense work's kernel launches from Python, which no system
needs."""

from __future__ import annotations

import torch

from kvoffload.kv.interface import KVOffloadSystem
from kvoffload.model.decoder import Decoder


class PiecewiseDecode:
    """token [B] -> logits [B, V] like Decoder.decode, with Decoder.dense_segment replayed from CUDA graphs.
    Build it after a few eager steps (lazily created library state must exist before capture)."""

    def __init__(self, model: Decoder, kv: KVOffloadSystem, batch: int, device: torch.device):
        self.model, self.kv = model, kv
        cfg = model.cfg
        dtype = model.lm_head.weight.dtype
        self.token = torch.zeros(batch, dtype=torch.long, device=device)
        self.o = torch.zeros(batch, cfg.num_heads, cfg.head_dim, dtype=dtype, device=device)
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.outs: list[tuple] = []
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        pool = None  # one memory pool: the segments replay in the order they were captured
        x = None
        for i in range(cfg.num_layers + 1):
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=pool, stream=stream):
                out = model.dense_segment(i, self.token, x, self.o, kv.position, kv.wants_speculative_query)
                if i < cfg.num_layers:  # the queries as the system sees them (a synthetic process's kernels)
                    x_i, q, k, v, q_spec = out
                    out = (x_i, *model.attention_queries(i, q, q_spec, kv.wants_speculative_query), k, v)
            pool = graph.pool()
            self.graphs.append(graph)
            self.outs.append(out)
            x = out[0]
        torch.cuda.current_stream(device).wait_stream(stream)

    @torch.inference_mode()
    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        self.token.copy_(token)
        for i, (graph, (_, q, q_next, k, v)) in enumerate(zip(self.graphs[:-1], self.outs[:-1])):
            graph.replay()
            # the outputs are the graph's static buffers: every system copies what it keeps of k and v
            if q_next is not None:
                self.kv.prepare(i + 1, q_next)
            self.o.copy_(self.kv.decode(i, q, k, v))
        self.graphs[-1].replay()
        return self.outs[-1][0]
