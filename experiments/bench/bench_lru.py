"""RetroInfer-style's CPU cache manager alone (baselines/lru.py, native backend), at Figure 10's shapes: what a
decode step's LRU costs on the host, by thread count, inline (the whole step between the sync and the fetch) and
deferred (the decision there, the state change in a worker beside the GPU's work). The step's host work is on its
critical path: this record says which thread count and which mode leave it shortest.

A shape is a (seqlen, batch) point: rows = batch x KV heads, each row looking up the step's blocks of
RetroInfer.geometry (its default config: top-k 10 %, 8-token blocks, a cache of 3x a step's blocks). The blocks
a row looks up follow a reuse process: each step keeps `--keep` of the previous step's blocks and draws the rest
uniformly from the others, so the hit rate lands near RetroInfer-style's in Figure 10 (0.84-0.86 at keep 0.85);
the record holds the hit rate it reached.

    python -m experiments.bench.bench_lru --out results/<folder>/lru.json     # on the GPU machine: its 16 cores
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

import numba
import numpy as np
import torch

from baselines.lru import BlockLRU
from baselines.retroinfer import RetroInfer
from experiments.bench.common import counts
from experiments.runner.records import environment, refuse
from experiments.runner.run_settings import parse_tokens
from kvoffload.errors import ConfigError
from kvoffload.paths import write_json_atomic

KV_HEADS = 8  # Llama-3-8B's


def block_steps(rows: int, n: int, n_blocks: int, keep: float, steps: int, seed: int) -> list[np.ndarray]:
    """steps x [rows, n] int32, each row's blocks distinct and ascending; a step keeps `keep` of the last."""
    rng = np.random.default_rng(seed)
    cur = np.stack([rng.choice(n_blocks, n, replace=False) for _ in range(rows)])
    out = []
    kept = int(round(n * keep))
    for _ in range(steps):
        nxt = np.empty_like(cur)
        for r in range(rows):
            old = rng.choice(cur[r], kept, replace=False)
            free = np.ones(n_blocks, bool)
            free[old] = False
            nxt[r] = np.concatenate([old, rng.choice(np.flatnonzero(free), n - kept, replace=False)])
        cur = nxt
        out.append(np.sort(cur, axis=1).astype(np.int32))
    return out


def time_mode(mode: str, lru: BlockLRU, steps: list[np.ndarray], warm: int) -> dict:
    """Median host microseconds of the step's critical part (and of the deferred state change) over the steps
    after `warm`, and the hit rate they reached."""
    rows, n = steps[0].shape
    dest, src = np.zeros((rows, n), np.int32), np.zeros((rows, n), np.int32)
    cnt = np.zeros(3, np.int64)
    crit, later, lookups, hits = [], [], 0, 0
    for i, blocks in enumerate(steps):
        t0 = time.perf_counter()
        if mode == "inline":
            lru.access_into(blocks, dest, src, cnt)
        else:
            lru.decide_into(blocks, dest, src, cnt)
        t1 = time.perf_counter()
        if mode == "deferred":
            lru.update(blocks)
        if i >= warm:
            crit.append(t1 - t0)
            later.append(time.perf_counter() - t1)
            lookups, hits = lookups + int(cnt[0]), hits + int(cnt[1])
    row = dict(critical_us=round(float(np.median(crit)) * 1e6, 2), hit_rate=round(hits / lookups, 4))
    if mode == "deferred":
        row["update_us"] = round(float(np.median(later)) * 1e6, 2)
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--points", default="8k:1,8k:8,8k:64,32k:1,32k:4,32k:16,128k:1,128k:2,128k:4", help="seqlen:batch pairs"
    )
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("--keep", type=float, default=0.85)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args(argv)
    try:
        threads = counts(args.threads, "threads")
        points = []
        for p in args.points.split(","):
            seqlen, _, batch = p.partition(":")
            if not batch.isdigit() or int(batch) < 1:
                raise ConfigError(f"--points {p!r}: each is seqlen:batch, e.g. 32k:4")
            points.append((parse_tokens(seqlen), int(batch)))
        if not 0 <= args.keep < 1 or args.steps < 11:
            raise ConfigError(f"--keep {args.keep} must be in [0, 1) and --steps {args.steps} at least 11")
        if max(threads) > numba.config.NUMBA_NUM_THREADS:
            raise ConfigError(f"--threads {max(threads)} exceeds numba's {numba.config.NUMBA_NUM_THREADS}")
    except ConfigError as e:
        refuse(e)
    geometry = RetroInfer().geometry
    rows_out = []
    for seqlen, batch in points:
        n_blocks, n, cap = geometry(seqlen)
        rows = batch * KV_HEADS
        steps = block_steps(rows, n, n_blocks, args.keep, args.steps, seed=seqlen + batch)
        for t in threads:
            for mode in ("inline", "deferred"):
                lru = BlockLRU(rows, n_blocks, cap, t, deferred=mode == "deferred")
                row = dict(seqlen=seqlen, batch=batch, rows=rows, blocks_per_step=n, cache_blocks=cap, threads=t)
                row |= dict(mode=mode, effective_threads=lru.threads, **time_mode(mode, lru, steps, warm=10))
                rows_out.append(row)
                print(row, flush=True)
    write_json_atomic(
        args.out,
        {
            "bench": "lru",
            "command": "python -m experiments.bench.bench_lru " + shlex.join(sys.argv[1:] if argv is None else argv),
            "cores": os.cpu_count(),
            "numba_threading_layer": numba.threading_layer(),
            "rows": rows_out,
            "environment": environment(torch.device("cpu")),
        },
    )


if __name__ == "__main__":
    main()
