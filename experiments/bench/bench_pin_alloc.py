"""How long pinning a sweep point's host KV store takes, by the way it is pinned, and whether that way changes how
fast the link then reads it: cudaHostAlloc (torch's default, hardware.pin_threads=0) against malloc'd pages first
touched by N threads, then cudaHostRegister (hardware.pin_threads=N), the same with transparent huge pages
(--thp-threads: the process runs with GLIBC_TUNABLES=glibc.malloc.hugetlb=1, so that malloc madvises its mmap'd
chunks MADV_HUGEPAGE and the first touch places 2 MiB pages where the system's THP mode is "madvise"), and
cudaHostAlloc called from P threads at once, a buffer each (--alloc-threads: whether the driver pins in parallel,
keeping cudaHostAlloc's memory). Pinning is most of a large Figure 10 point's setup (each record's
`stages.allocate`); memory pinned by threads was read more slowly by row gathers, and its pages are 4 KiB ones:
whether huge pages mend that is what this measures. Each row says how much of the process's memory was on huge
pages once pinned (`anon_huge_gib`).

Each way runs in a fresh process (the allocator's setting and its cache of pinned blocks are per process): it
allocates --gib in --layer-gib buffers (a layer's host store each, as kvoffload/offload/host.py allocates them),
times that and the free, and between the two measures the link on memory pinned the same way (bench_link's paths
at one volume: a bulk copy, the UVA gather, the CPU gather with 16 threads). On a CPU device nothing is pinned:
that run only checks the command and the record.

    python -m experiments.bench.bench_pin_alloc --gib 64 --threads 0,16 --thp-threads 16 --alloc-threads 16 \\
        --out pin_alloc.json                                                                             # GPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from experiments.bench.common import LLAMA3, bench_record, counts, sweep
from experiments.runner.run_settings import pin_threads, resolve_device
from kvoffload.errors import ConfigError
from kvoffload.offload.host import (
    anon_huge_gib,
    empty_host_cache,
    host_buffer,
    huge_pages_enabled,
    pin_by_register,
    thp_env,
)
from kvoffload.paths import write_json_atomic

GIB = 2**30


def one_way(
    threads: int, gib: float, layer_gib: float, link_tokens: int, device: torch.device, alloc_threads: int = 1
) -> dict:
    """This process pins the way `threads` says (with threads 0: cudaHostAlloc from `alloc_threads` threads, a
    buffer each), once: the row of that way."""
    cuda = device.type == "cuda"
    if cuda:
        pin_by_register(threads)
    n_layers = max(1, round(gib / layer_gib))
    layer_bytes = int(layer_gib * GIB)
    start = time.perf_counter()
    with ThreadPoolExecutor(alloc_threads) as pool:
        stores = list(pool.map(lambda _: host_buffer((layer_bytes,), torch.uint8, cuda), range(n_layers)))
    alloc_s = time.perf_counter() - start
    huge = anon_huge_gib()
    link = sweep(device, [link_tokens], [16], LLAMA3.num_kv_heads, LLAMA3.head_dim, 0.1, 5, 32)  # a layer of Llama-3-8B
    start = time.perf_counter()
    del stores
    if cuda:
        empty_host_cache()
    free_s = time.perf_counter() - start
    total = n_layers * layer_bytes
    thp = huge_pages_enabled()
    return {
        "threads": threads,
        "way": ("cudaHostRegister" + (" + THP" if thp else "")) if threads else "cudaHostAlloc",
        "thp": thp,
        "anon_huge_gib": huge,
        "alloc_threads": 1 if threads else alloc_threads,
        "pinned": cuda,
        "bytes": total,
        "layers": n_layers,
        "alloc_s": round(alloc_s, 3),
        "alloc_gb_s": round(total / alloc_s / 1e9, 3),
        "free_s": round(free_s, 3),
        "link": link,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--gib", type=float, default=64.0, help="host memory pinned by each way")
    ap.add_argument("--layer-gib", type=float, default=2.0, help="one buffer's size (a layer's store)")
    ap.add_argument("--threads", default="0,8,16", help="ways: 0 = cudaHostAlloc, N = N threads + cudaHostRegister")
    ap.add_argument("--thp-threads", default="", help="more ways: N threads + cudaHostRegister on huge pages")
    ap.add_argument("--alloc-threads", default="", help="more ways: cudaHostAlloc from P threads at once, e.g. 16")
    ap.add_argument("--link-tokens", type=int, default=32768, help="the link's volume (a 128K layer's top-k)")
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: this way only (threads:alloc), to --out
    args = ap.parse_args(argv)
    try:
        ways = [(pin_threads(n, "--threads"), 1, False) for n in args.threads.split(",")]
        thp = [pin_threads(n, "--thp-threads") for n in args.thp_threads.split(",")] if args.thp_threads else []
        if 0 in thp:
            raise ConfigError("--thp-threads 0: huge pages apply to malloc'd pages, which cudaHostAlloc does not use")
        ways += [(n, 1, True) for n in thp]
        ways += [(0, p, False) for p in counts(args.alloc_threads, "alloc-threads")] if args.alloc_threads else []
        if not 0 < args.layer_gib <= args.gib:
            raise ConfigError(f"--layer-gib {args.layer_gib}: must be in (0, --gib]")
        device = resolve_device(args.device)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if args.one is not None:
        n, p = map(int, args.one.split(":"))
        write_json_atomic(args.out, one_way(n, args.gib, args.layer_gib, args.link_tokens, device, p))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, p, thp in ways:
            child = Path(tmp) / f"{n}_{p}_{thp}.json"
            cmd = [sys.executable, "-m", "experiments.bench.bench_pin_alloc", "--one", f"{n}:{p}", "--out", str(child)]
            cmd += ["--gib", str(args.gib), "--layer-gib", str(args.layer_gib), "--device", args.device]
            cmd += ["--link-tokens", str(args.link_tokens)]
            subprocess.run(cmd, check=True, env=thp_env(dict(os.environ), on=thp))
            row = json.loads(child.read_text())
            rows.append(row)
            bulk = next(r["gb_s"] for r in row["link"] if r["path"] == "bulk")
            print(
                f"{row['way']:<23} {n or p:>3} threads: {row['bytes'] / GIB:.1f} GiB in {row['alloc_s']:.2f} s "
                f"({row['alloc_gb_s']:.2f} GB/s), freed in {row['free_s']:.2f} s; bulk copy {bulk:.1f} GB/s"
            )
    record = bench_record(
        "pin_alloc", "experiments.bench.bench_pin_alloc", argv, device, rows, link_tokens=args.link_tokens
    )
    write_json_atomic(args.out, record)
    print(f"{len(rows)} rows -> {args.out}")


if __name__ == "__main__":
    main()
