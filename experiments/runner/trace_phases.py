"""A decode step's phases from its Chrome trace (`trace_dir=` of the run command), for steps that CUDA events cannot
split: a step replayed from one CUDA graph (CLO, FullAttn) is timed whole. The compute stream's time is the step's
critical path; it is divided into
- its own kernels, each in the phase its name says (PHASE_RULES; the model's dense work is "other"), and
- its idle gaps: a gap that ends after another stream's work (a retrieval on a side stream, a copy or a gather over
  the link) was spent waiting for that work and takes its phase ("transfer" counts as transfer_exposed); a gap
  with nothing on another stream before it is the host's (launch_sync).
The parts sum to the compute stream's span, the step's GPU time in the trace.

The run's record keeps them (`trace_phase_ms`, experiments.runner.step_metrics.trace_phases); `python -m
experiments.traces.step_phases <trace>` prints them for any trace."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

# first match wins; names are Triton kernel names of kvoffload/kernels and torch's / flashinfer's CUDA kernels
PHASE_RULES = (
    ("transfer_exposed", r"uva_gather|copy_blocks|Memcpy HtoD|memcpy32"),
    ("retrieval", r"hash_score|histogram|compact|encode_query|topk|TopK|radix|RadixSort|sort_kernel|partial_score"),
    ("attention", r"_split_kernel|_merge_kernel|flash|decode_attention|attention|BatchDecode|SingleDecode"),
    ("cache_mgmt", r"cache_update|slot|lookup|index_put|scatter"),
)
GAP_US = 1.0  # idle time on the compute stream shorter than this is the launch of back-to-back kernels


def load_events(path: Path, cats: tuple[str, ...] = ("kernel", "gpu_memcpy")) -> list[dict]:
    """The trace's GPU events of those categories as {name, stream, start, end} (us), by start; a .gz is read as
    gzip."""
    text = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    events = [e for e in json.loads(text)["traceEvents"] if e.get("cat") in cats]
    return sorted(
        (
            {
                "name": e["name"],
                "stream": e["args"].get("stream"),
                "start": e["ts"],
                "end": e["ts"] + e["dur"],
                "bytes": e["args"].get("bytes"),
            }
            for e in events
        ),
        key=lambda k: k["start"],
    )


def phase_of(name: str) -> str:
    for phase, pattern in PHASE_RULES:
        if re.search(pattern, name):
            return phase
    return "other"


def step_phases(events: list[dict]) -> dict[str, float]:
    """events: kernels and copies {name, stream, start, end} (us) of one step -> ms per phase on the compute
    stream, summing to its span."""
    if not events:
        raise ValueError("no GPU kernels in the trace (a CPU run records operators, not kernels)")
    busy: dict = {}
    for e in events:  # the compute stream: the most kernel time outside transfers (a gather can be the longest)
        if phase_of(e["name"]) != "transfer_exposed":
            busy[e["stream"]] = busy.get(e["stream"], 0.0) + e["end"] - e["start"]
    compute = max(busy, key=busy.get) if busy else events[0]["stream"]
    own = [e for e in events if e["stream"] == compute]
    others = [e for e in events if e["stream"] != compute]
    us = {p: 0.0 for p, _ in PHASE_RULES} | {"launch_sync": 0.0, "other": 0.0}
    for e in own:
        us[phase_of(e["name"])] += e["end"] - e["start"]
    for a, b in zip(own, own[1:]):
        idle = b["start"] - a["end"]
        if idle <= GAP_US:
            us["other"] += max(idle, 0.0)
            continue
        before = [o for o in others if a["start"] < o["end"] <= b["start"] + 0.5]
        waited = max(before, key=lambda o: o["end"]) if before else None
        phase = phase_of(waited["name"]) if waited is not None else "launch_sync"
        us[phase] += idle
    return {p: round(v / 1e3, 4) for p, v in us.items()}
