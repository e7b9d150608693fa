"""The CPU gather of InfiniGen-style's fetch (baselines/cpu_fetch.py) alone, by what it might depend on: the host
pool's size and memory kind, the index pattern, the thread count and the chunk size. Why its gather reaches less
than the link benchmark's 16-thread CPU gather (experiments.bench.bench_link) is read from this record.

A pool is one layer's host store, [heads, tokens, 512 B rows]; a gather takes `--fraction` of each head's rows:
  random        uniform over the whole pool (the calibration's pattern before it used a step's own indices)
  head_sorted   per head, a sorted random `fraction` of its rows (a step's top-k, as the fetch reads it, in order)
  head_unsorted the same rows in random order (top-k by score)
Memory kinds: pinned (torch pin_memory, as the host store is made), pageable (malloc'd, transparent huge pages as
the system sets them) and hugepage (pageable with madvise(MADV_HUGEPAGE), then cudaHostRegister'd: pinned too).

    python -m experiments.bench.bench_host_gather --out results/investigations/infinigen_cpu_fetch/host_gather.json
    (on a GPU)
"""

from __future__ import annotations

import argparse
import ctypes
import shlex
import sys
from pathlib import Path

import torch

from baselines.cpu_fetch import gather_gb_s
from experiments.bench.common import counts
from experiments.runner.records import environment, refuse
from kvoffload.errors import ConfigError
from kvoffload.paths import write_json_atomic

HUGE = 2 << 20
MADV_HUGEPAGE = 14
KINDS = ("pinned", "pageable", "hugepage")


def pool(kind: str, rows: int, row_elems: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pool [rows, row_elems] bf16 filled, its owner). hugepage: madvised before the first touch."""
    n = rows * row_elems
    if kind == "pinned":
        t = torch.empty(n, dtype=torch.bfloat16, pin_memory=torch.cuda.is_available())
        return t.view(rows, row_elems).normal_(), t
    raw = torch.empty(n * 2 + 2 * HUGE, dtype=torch.uint8)
    start = (raw.data_ptr() + HUGE - 1) // HUGE * HUGE - raw.data_ptr()
    body = raw[start : start + n * 2]
    if kind == "hugepage":
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.madvise(ctypes.c_void_p(body.data_ptr()), ctypes.c_size_t(body.numel()), MADV_HUGEPAGE)
    t = body.view(torch.bfloat16).view(rows, row_elems).normal_()  # the first touch: after the madvise
    if kind == "hugepage" and torch.cuda.is_available():
        torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * 2, 0)
    return t, raw


def indices(pattern: str, heads: int, tokens: int, fraction: float, gen: torch.Generator) -> torch.Tensor:
    k = max(1, int(tokens * fraction))
    if pattern == "random":
        return torch.randint(heads * tokens, (heads * k,), generator=gen)
    per = [torch.randperm(tokens, generator=gen)[:k] for _ in range(heads)]
    per = [p.sort().values if pattern == "head_sorted" else p for p in per]
    return torch.cat([p + h * tokens for h, p in enumerate(per)])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--tokens", default="131072,524288,2097152", help="tokens per head of each pool")
    ap.add_argument("--fraction", type=float, default=0.1)
    ap.add_argument("--threads", default="8,16")
    ap.add_argument("--chunks", default="8192,65536")
    ap.add_argument("--kinds", default="pinned,pageable,hugepage")
    args = ap.parse_args(argv)
    try:
        pools, threads, chunks = (counts(getattr(args, k), k) for k in ("tokens", "threads", "chunks"))
        kinds = args.kinds.split(",")
        if set(kinds) - set(KINDS):
            raise ConfigError(f"--kinds {args.kinds!r}: each one of {', '.join(KINDS)}")
        if "hugepage" in kinds and not sys.platform.startswith("linux"):
            raise ConfigError("--kinds hugepage needs Linux (madvise)")
        if not 0 < args.fraction <= 1 or args.heads < 1:
            raise ConfigError(f"--fraction {args.fraction} must be in (0, 1] and --heads {args.heads} at least 1")
    except ConfigError as e:
        refuse(e)
    row_elems = 256  # K and V of head_dim 128, bf16: 512 B
    gen = torch.Generator().manual_seed(0)
    pin = torch.cuda.is_available()
    rows = []
    for tokens in pools:
        for kind in kinds:
            host, owner = pool(kind, args.heads * tokens, row_elems)
            for pattern in ("random", "head_sorted", "head_unsorted"):
                idx = indices(pattern, args.heads, tokens, args.fraction, gen)
                staging = torch.empty(idx.shape[0], row_elems, dtype=torch.bfloat16, pin_memory=pin)
                for n in threads:
                    for chunk in chunks:
                        staging.zero_()
                        gb_s = gather_gb_s(host, staging, n, idx, chunk, repeats=4)  # the fetch's own gather
                        row = dict(pool_gb=round(host.numel() * 2 / 2**30, 2), kind=kind, pattern=pattern)
                        row |= dict(threads=n, chunk=chunk, rows=idx.shape[0], gb_s=round(gb_s, 2))
                        row["exact_rows"] = torch.equal(staging, host[idx])
                        rows.append(row)
                        print(row, flush=True)
            if kind == "hugepage" and torch.cuda.is_available():
                torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
            del host, owner
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    write_json_atomic(
        args.out,
        {
            "bench": "host_gather",
            "command": "python -m experiments.bench.bench_host_gather "
            + shlex.join(sys.argv[1:] if argv is None else argv),
            "transparent_hugepage": thp.read_text().strip() if thp.exists() else None,
            "rows": rows,
            "environment": environment(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
        },
    )


if __name__ == "__main__":
    main()
