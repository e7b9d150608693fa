"""Touches most of this machine's free host memory once, then frees it: a warm-up before a sweep of host-bound runs.

On the lent GPU machine (a virtual machine) the first job of a fresh machine gathered from its host memory at a fraction
of the rate later jobs reached (results/investigations/infinigen_threads/). If the host backs a guest's pages on their
first touch, one pass over the memory before the sweep gives every job pages already backed. Prints the rate of each
chunk's first touch, so the call's log shows whether first touch is slow here at all.

    python3 scripts/touch_host_memory.py [--gb N]   # default: 85 % of MemAvailable
"""

from __future__ import annotations

import argparse
import time

import torch

CHUNK_GB = 1


def available_gb() -> float:
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=None, help="GiB to touch (default: 85 %% of MemAvailable)")
    args = ap.parse_args()
    total = args.gb if args.gb is not None else 0.85 * available_gb()
    if not 0 < total <= available_gb():
        raise SystemExit(f"--gb {total:.1f} must lie in (0, {available_gb():.1f}] (MemAvailable)")
    held, rates = [], []
    for _ in range(int(total // CHUNK_GB)):
        t0 = time.perf_counter()
        held.append(torch.ones(CHUNK_GB << 30, dtype=torch.uint8))  # every page written once
        rates.append(CHUNK_GB / (time.perf_counter() - t0))
    print(
        f"touched {len(held) * CHUNK_GB} GiB; first-touch GiB/s per {CHUNK_GB} GiB chunk: "
        f"first {rates[0]:.1f}, median {sorted(rates)[len(rates) // 2]:.1f}, last {rates[-1]:.1f}"
        if rates
        else ""
    )
    del held


if __name__ == "__main__":
    main()
