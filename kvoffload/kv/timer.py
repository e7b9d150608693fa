"""One phase timer shared by every system, so that every breakdown uses the same names and the same clock.

On CUDA each phase is a pair of events on the current stream, resolved only when the step ends (no host sync
inside the step); on CPU it is a perf_counter interval. 'other' is never timed directly: it is the step's
time minus the named phases, so it holds the model's dense layers and anything a system did not label.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

PHASES = ("retrieval", "cache_mgmt", "transfer_exposed", "attention", "launch_sync", "other")
TIMED_PHASES = PHASES[:-1]


class PhaseTimer:
    def __init__(self, device: torch.device, enabled: bool = True):
        self.cuda = device.type == "cuda"
        self.enabled = enabled
        self._marks: list[tuple[str, object, object]] = []
        self._step: tuple[object, object] | None = None

    def _now(self) -> object:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    @staticmethod
    def _ms(a: object, b: object) -> float:
        if isinstance(a, float):
            return (b - a) * 1e3  # type: ignore[operator]
        return a.elapsed_time(b)  # type: ignore[union-attr]

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in TIMED_PHASES:
            raise ValueError(f"unknown phase {name!r}; valid: {', '.join(TIMED_PHASES)}")
        if not self.enabled or self._step is None:
            yield
            return
        start = self._now()
        yield
        self._marks.append((name, start, self._now()))

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Work that overlaps the timed stream (a side stream) is not a phase of the step's latency: only what
        the timed stream waits for it is, and the caller times that wait."""
        enabled, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = enabled

    def begin_step(self) -> None:
        self._marks.clear()
        self._step = (self._now(), None)

    def end_step(self) -> dict[str, float]:
        """Milliseconds per phase for the step just finished, 'other' and 'total' included."""
        if self._step is None:
            raise RuntimeError("end_step() without begin_step()")
        end = self._now()
        if self.cuda:
            end.synchronize()  # type: ignore[union-attr]
        total = self._ms(self._step[0], end)
        out = {p: 0.0 for p in PHASES}
        if self.enabled:
            for name, a, b in self._marks:
                out[name] += self._ms(a, b)
        out["other"] = max(total - sum(out[p] for p in TIMED_PHASES), 0.0)
        out["total"] = total
        self._step = None
        self._marks.clear()
        return out
