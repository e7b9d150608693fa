"""Greedy generation over a KV system: prefill, then one decode step per token, with per-step statistics.
On CUDA the decode step can be captured once in a CUDA graph and replayed (gpt-fast's 'reduce-overhead'):
at batch 1 an eager step is bound by its dozens of kernel launches per layer, not by memory."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvoffload.kv.interface import KVOffloadSystem, StepStats
from kvoffload.model.decoder import Decoder
from kvoffload.piecewise import PiecewiseDecode


@dataclass
class Generation:
    tokens: torch.Tensor  # [B, N] generated ids
    prefill_s: float
    decode_s: float
    steps: list[StepStats] = field(default_factory=list)
    steady_from: int = 0  # the first step that replays a captured graph (the capture step before it is slow)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens produced per second of decode wall time, summed over the batch."""
        return len(self.steps) * self.tokens.shape[0] / self.decode_s if self.steps else 0.0


DECODE_MODES = ("eager", "graph", "piecewise")
KV_FILLS = ("prefill", "projection", "key_process")


class DecodeStep:
    """token [B] -> next token [B] through model.decode. mode graph: the whole step is captured in one CUDA graph;
    piecewise: only the model's dense work between attention calls is (kvoffload.piecewise), for systems that talk to
    the host inside a step; eager: no graph. With a graph the first `warmup` calls run eagerly (on the capture
    stream, so that lazily created library state exists before capture), then the graph is captured and every
    call from then on replays it. Inputs and output live in static buffers."""

    def __init__(
        self,
        model: Decoder,
        kv: KVOffloadSystem,
        batch: int,
        device: torch.device,
        mode: str = "eager",
        warmup: int = 2,
    ):
        if mode not in DECODE_MODES:
            raise ValueError(f"decode mode {mode!r}; valid: {', '.join(DECODE_MODES)}")
        self.model, self.kv, self.warmup, self.mode, self.batch = model, kv, warmup, mode, batch
        self.token = torch.zeros(batch, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | PiecewiseDecode | None = None
        self.calls = 0
        if mode == "graph":
            kv.use_static_shapes()
        if mode != "eager":
            self.stream = step_stream(device)

    def _step(self) -> torch.Tensor:
        return self.model.decode(self.token, self.kv.position, self.kv).argmax(-1)

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        self.token.copy_(token)
        if self.mode == "eager":
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
            if self.mode == "piecewise":
                self.graph = PiecewiseDecode(self.model, self.kv, self.batch, self.token.device)
            else:
                self.graph = torch.cuda.CUDAGraph()
                with torch.inference_mode(), torch.cuda.graph(self.graph, stream=self.stream):
                    self.out = self._step()
                current.wait_stream(self.stream)
        if self.mode == "piecewise":
            return self.graph(self.token).argmax(-1)
        self.graph.replay()
        return self.out.clone()


def step_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream a decode step is captured on, at the device's highest priority (-100 is clamped to it): graph
    nodes keep their stream's priority, so a system's helper streams (CLO's side and copy streams, default
    priority) take SMs only where the step's own kernels leave them free, and the step's short kernels do not
    queue behind a helper kernel's blocks."""
    return torch.cuda.Stream(device, priority=-100)


def sync_device(device: torch.device) -> None:
    """Waits for the device's queued work (timing boundaries); nothing to wait for on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(
    model: Decoder,
    kv: KVOffloadSystem,
    prompt: torch.Tensor,
    max_new_tokens: int,
    stop_ids: set[int] | frozenset[int] = frozenset(),
    decode_mode: str = "eager",
    on_prefill_layer: Callable[[int], None] | None = None,
    on_token: Callable[[int], None] | None = None,
    kv_fill: str = "prefill",
    on_filled: Callable[[], None] | None = None,
) -> Generation:
    """prompt [B, T]. Stops early only when every sequence has emitted a stop id. kv_fill: "prefill" (the model's
    prefill), "projection" (Decoder.fill: each layer's K/V projection of the embeddings, for speed runs) or
    "key_process" (Decoder.fill with the model's key_process drawing the keys)."""
    if kv_fill not in KV_FILLS:
        raise ValueError(f"kv_fill {kv_fill!r}; valid: {', '.join(KV_FILLS)}")
    dev = prompt.device
    sync_device(dev)
    t0 = time.perf_counter()
    fill = model.prefill if kv_fill == "prefill" else model.fill
    logits = fill(prompt, kv, on_layer=on_prefill_layer)
    token = logits.argmax(-1)
    sync_device(dev)
    prefill_s = time.perf_counter() - t0
    if on_filled is not None:
        on_filled()
    step = DecodeStep(model, kv, prompt.shape[0], dev, decode_mode)
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
    sync_device(dev)
    return Generation(
        torch.stack(out, dim=1),
        prefill_s,
        time.perf_counter() - t0,
        steps,
        steady_from=0 if decode_mode == "eager" else step.warmup + 1,
    )
