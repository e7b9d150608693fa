"""Where a decode step's GPU time goes, from a Chrome trace (`trace_dir=...` of the run command, or the layer
benchmark's --trace): per stream, the kernels' busy time; on the compute stream (the one of the longest kernel), its
idle gaps and the kernel of another stream that ended just before each gap closed (what the compute stream waited for);
the copies by direction with their achieved bandwidth, and the host round trips: how long the GPU stays idle after
each device-to-host copy (a system that syncs on it waits for the host to act on what it read).

    python -m experiments.traces.step_timeline results/.../decode_step.trace.json [--gaps 15]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from statistics import median

from experiments.runner.trace_phases import load_events


def family(name: str) -> str:
    """torch: its own small kernels (elementwise, reductions, draws, index, cat, copies); cublas: GEMMs; else the
    kernel's name (Triton kernels: the project's own)."""
    if name.startswith("void at::native") or name.startswith("memcpy32") or name.startswith("Memcpy"):
        return "torch"
    if name.startswith("nvjet") or "cublas" in name or "gemm" in name.lower():
        return "cublas"
    return name[:50]


def kernels(path: Path) -> list[dict]:
    return load_events(path, ("kernel",))


def idle_by_next(gaps: list[dict]) -> list[dict]:
    by = defaultdict(lambda: [0.0, 0])
    for g in gaps:
        by[g["next_family"]][0] += g["idle_us"]
        by[g["next_family"]][1] += 1
    return [{"next": n, "us": round(t, 1), "gaps": c} for n, (t, c) in sorted(by.items(), key=lambda kv: -kv[1][0])]


def summary(ks: list[dict], n_gaps: int) -> dict:
    if not ks:
        raise SystemExit("no GPU kernels in the trace (a CPU run records operators, not kernels)")
    by_stream = defaultdict(list)
    for k in ks:
        by_stream[k["stream"]].append(k)
    span = ks[-1]["end"] - ks[0]["start"]
    busy = {s: round(sum(k["end"] - k["start"] for k in v), 1) for s, v in by_stream.items()}
    compute = max(ks, key=lambda k: k["end"] - k["start"])["stream"]  # the longest kernel: a GEMV or attention
    gaps = []
    own = by_stream[compute]
    for a, b in zip(own, own[1:]):
        if b["start"] - a["end"] > 1.0:
            others = [k for k in ks if k["stream"] != compute and k["end"] <= b["start"] + 0.5]
            waited = max(others, key=lambda k: k["end"])["name"][:50] if others else None
            gaps.append(
                {
                    "at_us": round(a["end"] - ks[0]["start"], 1),
                    "idle_us": round(b["start"] - a["end"], 1),
                    "next": b["name"][:40],
                    "next_family": family(b["name"]),
                    "after_other_stream": waited,
                }
            )
    kernel_time = defaultdict(float)
    for k in ks:
        kernel_time[(k["stream"], k["name"][:50])] += k["end"] - k["start"]
    top = sorted(kernel_time.items(), key=lambda kv: -kv[1])[:20]
    # by family over every stream: a replayed graph spreads one kernel's launches over the streams of its branches
    by_family = defaultdict(lambda: [0.0, 0])
    for k in ks:
        totals = by_family[family(k["name"])]
        totals[0] += k["end"] - k["start"]
        totals[1] += 1
    return {
        "span_us": round(span, 1),
        "kernels": len(ks),
        "busy_us": round(sum(busy.values()), 1),
        "busy_us_by_family": [
            {"name": n, "us": round(t, 1), "launches": c}
            for n, (t, c) in sorted(by_family.items(), key=lambda kv: -kv[1][0])[:25]
        ],
        "busy_us_by_stream": busy,
        "compute_stream": compute,
        "compute_idle_us": round(sum(g["idle_us"] for g in gaps), 1),
        # what the compute stream waited to start: the kernel family after each idle gap, summed
        "compute_idle_us_by_next": idle_by_next(gaps),
        "largest_gaps": sorted(gaps, key=lambda g: -g["idle_us"])[:n_gaps],
        "top_kernels_us": [{"stream": s, "name": n, "us": round(t, 1)} for (s, n), t in top],
    }


BULK_BYTES = 64 << 10  # a copy of at least this many bytes moves data; smaller ones move indices and lengths


def copy_stats(cs: list[dict]) -> dict:
    rates = [e["bytes"] / (e["end"] - e["start"]) / 1e3 for e in cs if e["bytes"] and e["end"] > e["start"]]
    return {
        "copies": len(cs),
        "median_bytes": median([e["bytes"] or 0 for e in cs]),
        "median_us": round(median([e["end"] - e["start"] for e in cs]), 1),
        "median_gb_s": round(median(rates), 2) if rates else None,
    }


def copies(events: list[dict]) -> dict:
    """Per direction (the trace's `Memcpy HtoD/DtoH/DtoD`): how many, their median bytes, duration and GB/s, and the
    same for its copies of BULK_BYTES or more ("bulk") where it also has smaller ones (a median over both sizes is
    neither); and after each device-to-host copy the GPU's idle time until its next event on any stream (median and
    sum, us)."""
    out = {}
    for kind in ("HtoD", "DtoH", "DtoD"):
        cs = [e for e in events if e["name"].startswith(f"Memcpy {kind}")]
        if cs:
            out[kind] = copy_stats(cs)
            bulk = [e for e in cs if (e["bytes"] or 0) >= BULK_BYTES]
            if bulk and len(bulk) < len(cs):
                out[kind]["bulk"] = copy_stats(bulk)
    waits, busy_until = [], 0.0
    for i, e in enumerate(events):
        busy_until = max(busy_until, e["end"])  # the GPU is busy until every event begun so far has ended
        if e["name"].startswith("Memcpy DtoH"):
            nxt = next((n["start"] for n in events[i + 1 :] if n["start"] >= e["end"]), None)  # events by start
            if nxt is not None:
                waits.append(max(0.0, nxt - busy_until))
    out["idle_after_dtoh_us"] = {"median": round(median(waits), 1), "sum": round(sum(waits), 1)} if waits else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--gaps", type=int, default=15)
    args = ap.parse_args()
    events = load_events(args.trace)  # kernels and copies, read once (a trace is a few MB of JSON)
    ks = [e for e in events if not e["name"].startswith("Memcpy ")]  # the copies' names: copies()
    print(json.dumps({**summary(ks, args.gaps), "copies": copies(events)}, indent=1))


if __name__ == "__main__":
    main()
