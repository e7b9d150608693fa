"""Decoding one request through a system after its prefill: greedy generation that stops on a stop string, and
teacher-forced scoring of a continuation (each of its tokens is a decode step, so the system's attention scores it
as it would its own generated tokens). Batch 1: lm-eval's requests are taken one at a time."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvoffload.generate import DecodeStep, sync_device
from kvoffload.kv.interface import KVOffloadSystem, StepStats
from kvoffload.kv.timer import PHASES
from kvoffload.model.decoder import Decoder


@dataclass
class DecodeRun:
    tokens: list[int]
    seconds: float
    steps: list[StepStats] = field(default_factory=list)
    logprob: float | None = None  # teacher forcing: the continuation's log-likelihood
    greedy: bool | None = None  # teacher forcing: whether greedy decoding would have produced it

    def stats(self) -> dict:
        """Per-request decode statistics for the record."""
        n = len(self.steps)
        lookups = sum(s.lookups for s in self.steps)
        return {
            "decode_steps": n,
            "decode_s": round(self.seconds, 4),
            "decode_ms_per_step": round(self.seconds * 1e3 / n, 3) if n else None,
            "phase_ms_per_step": {p: round(sum(s.phase_ms.get(p, 0.0) for s in self.steps) / n, 3) for p in PHASES}
            if n
            else None,
            "lookups": lookups,
            "hit_rate": round(sum(s.hits for s in self.steps) / lookups, 4) if lookups else None,
            "bytes_h2d": sum(s.bytes_h2d for s in self.steps),
            "host_syncs": sum(s.host_syncs for s in self.steps),
        }


def greedy_until(
    model: Decoder,
    kv: KVOffloadSystem,
    first_logits: torch.Tensor,
    max_new: int,
    stop_ids: set[int],
    stop: Callable[[list[int]], bool],
    decode_mode: str = "eager",
) -> DecodeRun:
    """first_logits [1, V] (the prefill's) -> up to max_new greedy tokens; ends after a stop id, or as soon as
    stop(tokens so far) is true (lm-eval's stop strings)."""
    device = first_logits.device
    token = first_logits.argmax(-1)
    out = [int(token)]
    step = DecodeStep(model, kv, 1, device, decode_mode)
    steps: list[StepStats] = []
    t0 = time.perf_counter()
    while len(out) < max_new and out[-1] not in stop_ids and not stop(out):
        kv.begin_step()
        token = step(token)
        steps.append(kv.end_step())
        out.append(int(token))
    sync_device(device)
    return DecodeRun(out, time.perf_counter() - t0, steps)


def teacher_forced(
    model: Decoder, kv: KVOffloadSystem, first_logits: torch.Tensor, continuation: list[int]
) -> DecodeRun:
    """The log-likelihood of `continuation` after the prefilled context: its first token scored by the prefill's
    logits, each next one by a decode step fed the one before (eager: the step's full logits are needed)."""
    device = first_logits.device
    targets = torch.tensor(continuation, device=device)
    rows = [first_logits[0]]
    steps: list[StepStats] = []
    t0 = time.perf_counter()
    for tok in targets[:-1]:
        kv.begin_step()
        rows.append(model.decode(tok.view(1), kv.position, kv)[0])
        steps.append(kv.end_step())
    logp = torch.log_softmax(torch.stack(rows).float(), dim=-1)
    total = float(logp.gather(1, targets[:, None]).sum())
    greedy = bool((logp.argmax(-1) == targets).all())
    sync_device(device)
    return DecodeRun(continuation, time.perf_counter() - t0, steps, total, greedy)
