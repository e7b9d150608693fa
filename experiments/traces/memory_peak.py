"""What was alive on the device at a run's allocation peak, from a CUDA allocator snapshot (`memory_snapshot=<file>`
of experiments.run): the trace's allocations and frees are replayed in order, and the allocations alive at the
largest total are grouped by the innermost frame of this project's code that made them.

    python -m experiments.traces.memory_peak snapshot.pickle --out peak.json [--top 20]

The history starts before the run loads its weights and holds its last `max_entries` events; were it cut, the
allocations before its start are not seen (`unmatched_frees` counts their frees) and `peak_gb` is relative to it."""

from __future__ import annotations

import argparse
import json
import pickle
from collections import defaultdict
from pathlib import Path
from typing import Any

GB = 1024**3
OURS = ("/clo/", "/kvoffload/", "/baselines/", "/experiments/")  # the frames that name who allocated


def where(frames: list[dict[str, Any]]) -> str:
    """The innermost frame in this project's code (frames are innermost first), else the innermost of all."""
    for f in frames:
        name = f.get("filename", "")
        if any(part in name for part in OURS):
            return f"{name[name.rfind('/', 0, name.rfind('/')) + 1 :]}:{f.get('line')} {f.get('name')}"
    return f"{frames[0].get('filename')}:{frames[0].get('line')} {frames[0].get('name')}" if frames else "?"


def live_at_peak(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Replays alloc / free events: the allocations alive when their total was largest."""
    freed = "free_completed" if any(e["action"] == "free_completed" for e in events) else "free_requested"
    live: dict[int, dict[str, Any]] = {}
    total = peak = 0
    at_peak: dict[int, dict[str, Any]] = {}
    unmatched = 0
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > peak:
                peak, at_peak, peak_event = total, dict(live), i
        elif e["action"] == freed:
            gone = live.pop(e["addr"], None)
            if gone is None:
                unmatched += 1
            else:
                total -= gone["size"]
    return {"peak": peak, "live": list(at_peak.values()), "event": peak_event if peak else None, "unmatched": unmatched}


def summarise(snapshot: dict[str, Any], top: int = 20) -> dict[str, Any]:
    traces = [t for t in snapshot.get("device_traces", []) if t]
    if not traces:
        raise SystemExit("error: the snapshot has no allocation history (was it recorded with memory_snapshot=?)")
    events = traces[0]
    found = live_at_peak(events)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in found["live"]:
        g = groups[where(e.get("frames", []))]
        g[0] += e["size"]
        g[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {
        "events": len(events),
        "unmatched_frees": found["unmatched"],
        "peak_gb": round(found["peak"] / GB, 3),
        "peak_event": found["event"],
        "live_at_peak": [{"where": k, "gb": round(v[0] / GB, 3), "allocations": v[1]} for k, v in ranked[:top]],
        "rest_gb": round(sum(v[0] for _, v in ranked[top:]) / GB, 3),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("snapshot", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args(argv)
    if not args.snapshot.is_file():
        raise SystemExit(f"error: no snapshot at {args.snapshot}")
    with args.snapshot.open("rb") as f:
        summary = summarise(pickle.load(f), args.top)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary["live_at_peak"][:8], indent=1))


if __name__ == "__main__":
    main()
