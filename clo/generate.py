"""Greedy generation over a KV system: prefill, then one decode step per token, with per-step statistics.
On CUDA the decode step can be captured once in a CUDA graph and replayed (gpt-fast's 'reduce-overhead'):
at batch 1 an eager step is bound by ~45 kernel launches per layer, not by memory."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from clo.kv.interface import KVOffloadSystem, StepStats
from clo.model.decoder import Decoder


@dataclass
class Generation:
    tokens: torch.Tensor  # [B, N] generated ids
    prefill_s: float
    decode_s: float
    steps: list[StepStats] = field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens produced per second of decode wall time, summed over the batch."""
        return len(self.steps) * self.tokens.shape[0] / self.decode_s if self.steps else 0.0


class DecodeStep:
    """token [B] -> next token [B] through model.decode. In graph mode the first `warmup` calls run eagerly
    (on the capture stream, so that lazily created library state exists before capture); the next call
    captures the step, and every call from then on replays it. Inputs and output live in static buffers."""

    def __init__(self, model: Decoder, kv: KVOffloadSystem, batch: int, device: torch.device,
                 cuda_graph: bool, warmup: int = 2):
        self.model, self.kv, self.warmup = model, kv, warmup
        self.token = torch.zeros(batch, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.calls = 0
        self.cuda_graph = cuda_graph
        if cuda_graph:
            kv.use_static_shapes()
            self.stream = torch.cuda.Stream(device)

    def _step(self) -> torch.Tensor:
        return self.model.decode(self.token, self.kv.position, self.kv).argmax(-1)

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        self.token.copy_(token)
        if not self.cuda_graph:
            return self._step()
        if self.graph is None:
            current = torch.cuda.current_stream()
            self.stream.wait_stream(current)
            if self.calls < self.warmup:
                self.calls += 1
                with torch.cuda.stream(self.stream):
                    out = self._step()
                current.wait_stream(self.stream)
                return out
            self.graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(self.graph, stream=self.stream):
                self.out = self._step()
            current.wait_stream(self.stream)
        self.graph.replay()
        return self.out.clone()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(
    model: Decoder,
    kv: KVOffloadSystem,
    prompt: torch.Tensor,
    max_new_tokens: int,
    stop_ids: set[int] | frozenset[int] = frozenset(),
    cuda_graph: bool = False,
    on_prefill_layer: Callable[[int], None] | None = None,
    on_token: Callable[[int], None] | None = None,
) -> Generation:
    """prompt [B, T]. Stops early only when every sequence has emitted a stop id."""
    dev = prompt.device
    _sync(dev)
    t0 = time.perf_counter()
    logits = model.prefill(prompt, kv, on_layer=on_prefill_layer)
    token = logits.argmax(-1)
    _sync(dev)
    prefill_s = time.perf_counter() - t0
    step = DecodeStep(model, kv, prompt.shape[0], dev, cuda_graph)
    out = [token]
    stop = torch.tensor(sorted(stop_ids), device=dev, dtype=token.dtype)
    done = torch.isin(token, stop)
    steps: list[StepStats] = []
    t0 = time.perf_counter()
    for i in range(max_new_tokens - 1):
        if stop_ids and bool(done.all()):  # a host sync: only paid when there is something to stop on
            break
        kv.begin_step()
        token = step(token)
        steps.append(kv.end_step())
        out.append(token)
        done |= torch.isin(token, stop)
        if on_token is not None:
            on_token(i)
    _sync(dev)
    return Generation(torch.stack(out, dim=1), prefill_s, time.perf_counter() - t0, steps)
