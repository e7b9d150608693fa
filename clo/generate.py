"""Greedy generation over a KV system: prefill, then one decode step per token, with per-step statistics."""
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
        """Tokens produced per second of decode, summed over the batch."""
        return len(self.steps) * self.tokens.shape[0] / self.decode_s if self.steps else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(
    model: Decoder,
    kv: KVOffloadSystem,
    prompt: torch.Tensor,
    max_new_tokens: int,
    stop_ids: set[int] | frozenset[int] = frozenset(),
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
    out = [token]
    stop = torch.tensor(sorted(stop_ids), device=dev, dtype=token.dtype)
    done = torch.isin(token, stop)
    steps: list[StepStats] = []
    t0 = time.perf_counter()
    position = prompt.shape[1]
    for i in range(max_new_tokens - 1):
        if stop_ids and bool(done.all()):  # a host sync: only paid when there is something to stop on
            break
        kv.begin_step()
        logits = model.decode(token, position, kv)
        token = logits.argmax(-1)
        steps.append(kv.end_step())
        out.append(token)
        done |= torch.isin(token, stop)
        position += 1
        if on_token is not None:
            on_token(i)
    _sync(dev)
    return Generation(torch.stack(out, dim=1), prefill_s, time.perf_counter() - t0, steps)
