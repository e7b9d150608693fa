"""Paper Figures 3 and 13: the host -> device bandwidth each transfer path reaches, by transfer volume and by CPU
thread count, against a bulk pinned copy of the same bytes measured in the same run (issue 18, item 5).

A volume of T tokens is T selected rows of every KV head of one layer (Llama-3-8B shapes by default: 8 KV heads,
512 B rows of K and V), picked at random among T / fraction rows of the head (the top-k share of a context of
T / fraction tokens), as a layer's top-k lies in the host store. Paths, through kvoffload/offload/transfer.py:

  bulk        one contiguous pinned copy of the same bytes (the link's ceiling)
  uva         the GPU-initiated zero-copy gather (no CPU thread; CUDA only)
  cpu_gather  CPU gather into pinned staging by N threads, then one copy (the baselines' path), N in --threads

On a CPU device there is no link: `bulk` is a host copy and `cpu_gather` the engine's host reference gather, whose
thread count does not apply (its rows carry threads null); that run only checks the command and the record.

    python -m experiments.bench.bench_link --out results/fig3_13_link/record.json        # on a GPU
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from experiments.runner.preflight import parse_tokens
from experiments.runner.records import environment
from experiments.runner.timing import median_ms
from kvoffload.errors import ConfigError
from kvoffload.kernels.uva_gather import gather_rows_ref
from kvoffload.model.config import ModelConfig
from kvoffload.offload.transfer import TransferEngine
from kvoffload.paths import ROOT, write_json_atomic

LLAMA3 = ModelConfig.from_mapping(OmegaConf.load(ROOT / "conf/model/llama3.yaml"))


def counts(text: str, what: str, parse=int) -> list[int]:
    try:
        values = [parse(x) for x in text.split(",")]
    except (ValueError, ConfigError) as e:
        raise ConfigError(f"--{what} {text!r}: {e}") from None
    if not values or min(values) < 1:
        raise ConfigError(f"--{what} {text!r}: each must be at least 1")
    return values


def resolve_device(name: str) -> torch.device:
    """--device auto | cuda | cpu; cuda refused where there is none."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device here")
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)


def rate(nbytes: int, ms: float, bulk_ms: float) -> dict:
    """A timed copy's row fields: its bytes and time, GB/s and its share of the bulk copy's rate."""
    return {"bytes": nbytes, "ms": round(ms, 4), "gb_s": round(nbytes / ms / 1e6, 3), "of_bulk": round(bulk_ms / ms, 3)}


def bench_record(bench: str, module: str, argv: list[str] | None, device: torch.device, rows: list, **fields) -> dict:
    """A bench's record: what it measured, the command that ran it, its rows and the environment."""
    command = f"python -m {module} " + shlex.join(sys.argv[1:] if argv is None else argv)
    return {
        "bench": bench,
        "device": device.type,
        **fields,
        "command": command,
        "rows": rows,
        "environment": environment(device),
    }


def sweep(device, tokens, threads, kv_heads, head_dim, fraction, iters, uva_programs) -> list[dict]:
    pool = math.ceil(max(tokens) / fraction)
    cuda = device.type == "cuda"
    host = torch.randn(1, kv_heads, pool, 2, head_dim, dtype=torch.bfloat16)
    host = host.pin_memory() if cuda else host
    heads = torch.arange(kv_heads, device=device)
    rows = []
    for t in tokens:
        span = math.ceil(t / fraction)
        idx = torch.stack([torch.randperm(span)[:t].sort().values for _ in range(kv_heads)])[None].to(device)
        miss = torch.ones(1, kv_heads, dtype=torch.bool, device=device)
        slots = torch.zeros(1, kv_heads, t, 2, head_dim, dtype=torch.bfloat16, device=device)
        nbytes = slots.numel() * slots.element_size()
        src, dst = host.view(-1)[: slots.numel()], torch.empty(slots.numel(), dtype=torch.bfloat16, device=device)
        timed = [("bulk", None, lambda: dst.copy_(src, non_blocking=True))]
        engines = [("uva", None, TransferEngine("uva", 1, device, uva_programs))] if cuda else []
        engines += [("cpu_gather", n, TransferEngine("cpu_gather", n, device)) for n in (threads if cuda else [1])]
        for path, n, eng in engines:
            timed.append((path, n, lambda eng=eng: eng.fill(host, heads, idx, miss, slots)))
        bulk_ms = None
        for path, n, fn in timed:
            slots.zero_()
            ms = median_ms(fn, device, iters, warmup=1)
            bulk_ms = ms if path == "bulk" else bulk_ms
            row = {"path": path, "threads": n if cuda else None, "tokens": t} | rate(nbytes, ms, bulk_ms)
            if path != "bulk":
                want = gather_rows_ref(host, heads.cpu(), idx.cpu())
                row["exact_rows"] = torch.equal(slots.cpu(), want)
            rows.append(row)
            print(f"{t:>7} tokens {path:<10} {n or '':>2} {row['gb_s']:8.2f} GB/s = {row['of_bulk']:.2f} of bulk")
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", default="4k,8k,16k,32k,64k,128k", help="volumes: selected tokens per KV head")
    ap.add_argument("--threads", default="1,2,4,8,16", help="cpu_gather thread counts")
    ap.add_argument("--fraction", type=float, default=0.1, help="selected share of the rows a volume is drawn from")
    ap.add_argument("--kv-heads", type=int, default=LLAMA3.num_kv_heads)
    ap.add_argument("--head-dim", type=int, default=LLAMA3.head_dim)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--uva-programs", type=int, default=32, help="cap on the UVA gather's grid (conf/system)")
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    args = ap.parse_args(argv)
    try:
        tokens = counts(args.tokens, "tokens", parse_tokens)
        threads = counts(args.threads, "threads")
        if not 0 < args.fraction <= 1:
            raise ConfigError(f"--fraction {args.fraction}: must be in (0, 1]")
        device = resolve_device(args.device)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    rows = sweep(device, tokens, threads, args.kv_heads, args.head_dim, args.fraction, args.iters, args.uva_programs)
    record = bench_record(
        "link_bandwidth",
        "experiments.bench.bench_link",
        argv,
        device,
        rows,
        shape={"kv_heads": args.kv_heads, "head_dim": args.head_dim, "row_bytes": 2 * args.head_dim * 2},
        fraction=args.fraction,
        iters=args.iters,
        uva_programs=args.uva_programs,
    )
    write_json_atomic(args.out, record)
    print(f"{len(rows)} rows -> {args.out}")


if __name__ == "__main__":
    main()
