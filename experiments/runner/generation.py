"""A run's decode with progress bars and an optional one-step trace, and the wall time of each stage of a run."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from kvoffload.generate import Generation, generate
from kvoffload.kv.interface import GB


class StageMarks:
    """Each stage's wall time and the device's peak allocation so far at its end: startup (the process's age when
    the run begins: imports, Hydra), device (the system's build and the host's check, then the driver's and a
    context's start), measure, weights, allocate, fill, first_step (the first decode step, eager), decode. Where a
    sweep's time goes, and which stage set the record's peak_device_gb."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device, self.last = device, time.perf_counter()
        self.marks: dict[str, dict[str, float | None]] = {"startup": {"s": process_age_s(), "peak_gb": None}}

    def mark(self, stage: str) -> None:
        now = time.perf_counter()
        cuda = self.device is not None and self.device.type == "cuda"
        peak = torch.cuda.max_memory_allocated(self.device) / GB if cuda else None
        self.marks[stage] = {"s": round(now - self.last, 3), "peak_gb": None if peak is None else round(peak, 3)}
        self.last = now


def process_age_s() -> float | None:
    """Seconds since this process started (Linux's /proc), else None."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return round(uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"), 3)
    except (OSError, ValueError, IndexError):
        return None


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_generation(
    model,
    system,
    tokens,
    gen_tokens,
    stop,
    decode_mode,
    trace: Path | None = None,
    warmup: int = 0,
    kv_fill: str = "prefill",
    on_filled: Callable[[], None] | None = None,
    on_first_token: Callable[[], None] | None = None,
) -> Generation:
    """generate() with progress bars; with `trace`, the GPU kernels of one steady decode step (the first after
    the warm-up and a graph's capture) are written there as a Chrome trace (torch profiler; open in Perfetto)."""
    n_layers = model.cfg.num_layers
    # One bar at a time, so that a log (no terminal) does not interleave them: the decode bar opens once the KV is
    # filled, between the prefill's timing and the decode's.
    with contextlib.ExitStack() as bars, step_profiler(trace, warmup + 2) as prof:
        bar_p = bars.enter_context(
            tqdm(total=n_layers, desc=f"prefill {tokens.shape[1]} tokens", unit="layer", file=sys.stderr, leave=False)
        )
        bar_d = None

        def filled():
            nonlocal bar_d
            if on_filled is not None:
                on_filled()
            bar_p.close()
            bar_d = bars.enter_context(
                tqdm(total=gen_tokens - 1, desc="decode", unit="tok", file=sys.stderr, leave=False)
            )

        def on_token(_):
            if on_first_token is not None and bar_d.n == 0:
                on_first_token()
            bar_d.update(1)
            if prof is not None:
                prof.step()

        return generate(
            model,
            system,
            tokens,
            gen_tokens,
            stop,
            decode_mode,
            on_prefill_layer=lambda _: bar_p.update(1),
            on_token=on_token,
            kv_fill=kv_fill,
            on_filled=filled,
        )


@contextlib.contextmanager
def step_profiler(path: Path | None, skip: int):
    """A torch profiler that records the GPU kernels (on CPU runs: the operators) of the decode step after `skip`
    steps, then writes `path`."""
    if path is None:
        yield None
        return
    from torch.profiler import ProfilerActivity, profile, schedule

    path.parent.mkdir(parents=True, exist_ok=True)
    activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU  # CPU: its operators
    with profile(
        activities=[activity],
        schedule=schedule(wait=skip, warmup=1, active=1, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
    ) as prof:
        yield prof
