"""RetroInfer-style's block copy against CLO's row gather and a bulk copy of the same bytes, at Figure 10's shapes
(why: in a 128K step RetroInfer-style's copies ran well below the link rate the floor gives them).

One sparse layer's fetch of a point: every (sequence, KV head) row looks up the blocks its step selects (top-k share
of the middle, `block_size` tokens a block); `--hit` of the lookups hit the cache, the rest are misses whose blocks
come from pinned host memory. Paths, each moving the misses' bytes:

  bulk        one contiguous pinned copy of those bytes (the link's ceiling)
  blocks      uva_copy_blocks as RetroInfer-style's layer graph calls it: one entry per lookup, hits skipped; with
              --grids, also on other grids (programs x warps), to tell the kernel's grid from the link
  rows        CLO's UVA row gather (TransferEngine "uva") of the same rows, as one flat run

On a CPU device there is no link: the paths are the kernels' torch references, and only the command, the record
and the copies' exactness are checked.

    python -m experiments.bench.bench_block_copy --out block_copy.json     # on a GPU
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from experiments.bench.common import LLAMA3, bench_record, counts, rate
from experiments.runner.run_settings import parse_tokens, resolve_device
from experiments.runner.timing import median_ms
from kvoffload.errors import ConfigError
from kvoffload.kernels.uva_gather import copy_blocks_ref, uva_copy_blocks
from kvoffload.offload.transfer import TransferEngine
from kvoffload.paths import write_json_atomic


def point(device, seqlen, batch, hit, block_size, topk, kv_heads, head_dim, iters, uva_programs, grids) -> list[dict]:
    cuda = device.type == "cuda"
    rows = batch * kv_heads
    n_blocks = math.ceil(seqlen / block_size)
    per_row = max(1, math.ceil(topk * seqlen / block_size))  # lookups a row makes a step
    lookups = rows * per_row
    n_miss = max(1, round((1 - hit) * lookups))
    host = torch.randn(rows * n_blocks, block_size, 2, head_dim, dtype=torch.bfloat16)
    host = host.pin_memory() if cuda else host
    cache = torch.zeros(lookups, block_size, 2, head_dim, dtype=torch.bfloat16, device=device)  # a slot each
    src = torch.full((lookups,), -1, dtype=torch.int32)
    missed = torch.randperm(lookups)[:n_miss]
    src[missed] = ((missed // per_row) * n_blocks + torch.randint(n_blocks, (n_miss,))).to(torch.int32)
    dst = torch.arange(lookups, dtype=torch.int32)
    src_d, dst_d = src.to(device), dst.to(device)
    want = torch.zeros(lookups, block_size, 2, head_dim, dtype=torch.bfloat16)
    copy_blocks_ref(host, src, want, dst)
    # the same rows for the row gather: the missed blocks' rows, one flat run of a single "head"
    flat = host.view(1, 1, -1, 2, head_dim)
    idx = (src[src >= 0].long()[:, None] * block_size + torch.arange(block_size)).view(1, 1, -1).to(device)
    slots = torch.zeros(1, 1, idx.shape[-1], 2, head_dim, dtype=torch.bfloat16, device=device)
    heads, miss = torch.zeros(1, dtype=torch.long, device=device), torch.ones(1, 1, dtype=torch.bool, device=device)
    nbytes = slots.numel() * slots.element_size()
    bulk_src = host.view(-1)[: slots.numel()]
    bulk_dst = torch.empty(slots.numel(), dtype=torch.bfloat16, device=device)
    engine = TransferEngine("uva" if cuda else "cpu_gather", 1, device, uva_programs)

    def blocks(grid: tuple[int, int] | None):
        if not cuda:
            return lambda: copy_blocks_ref(host, src, cache, dst)
        return lambda: uva_copy_blocks(host, src_d, cache, dst_d, *(grid or ()))

    timed = [("bulk", None, lambda: bulk_dst.copy_(bulk_src, non_blocking=True)), ("blocks", None, blocks(None))]
    timed += [("blocks", g, blocks(g)) for g in (grids if cuda else [])]
    timed += [("rows", None, lambda: engine.fill(flat, heads, idx, miss, slots))]
    out, bulk_ms = [], None
    for path, grid, fn in timed:
        cache.zero_()
        ms = median_ms(fn, device, iters, warmup=1)
        bulk_ms = ms if path == "bulk" else bulk_ms
        row = {"path": path, "seqlen": seqlen, "batch": batch, "lookups": lookups, "misses": n_miss}
        row["grid"] = list(grid) if grid else None  # (programs, warps); None: the default the step runs
        row |= rate(nbytes, ms, bulk_ms)
        if path == "blocks":
            row["exact"] = torch.equal(cache.cpu(), want)
        elif path == "rows":
            row["exact"] = torch.equal(slots.cpu().view(-1, block_size, 2, head_dim), want[src >= 0])
        out.append(row)
        print(
            f"{seqlen:>7} x {batch:<3} {path:<7} {str(grid or ''):<10} {row['gb_s']:8.2f} GB/s "
            f"= {row['of_bulk']:.2f} of bulk ({nbytes / 1e6:.1f} MB)"
        )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seqlens", default="8k,32k,128k", help="prompt lengths (the middle is taken as the whole)")
    ap.add_argument("--batches", default="1,4", help="sequences")
    ap.add_argument("--hit", type=float, default=0.85, help="share of lookups that hit (Figure 10's: 0.85)")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--topk", type=float, default=0.1)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--uva-programs", type=int, default=None, help="the row gather's grid cap (RetroInfer: null)")
    ap.add_argument(
        "--grids", default="256x4,4096x4,1024x8", help="block copy grids besides the default: programs x warps"
    )
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    args = ap.parse_args(argv)
    try:
        seqlens = counts(args.seqlens, "seqlens", parse_tokens)
        batches = counts(args.batches, "batches")
        grids = [tuple(counts(g.replace("x", ","), "grids")) for g in args.grids.split(",") if g]
        if any(len(g) != 2 for g in grids):
            raise ConfigError(f"--grids {args.grids!r}: each is programs x warps, e.g. 1024x4")
        if not 0 <= args.hit < 1:
            raise ConfigError(f"--hit {args.hit}: must be in [0, 1)")
        if not 0 < args.topk <= 1 or args.block_size < 1:
            raise ConfigError(f"--topk {args.topk} must be in (0, 1] and --block-size {args.block_size} at least 1")
        device = resolve_device(args.device)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    rows = []
    for n in seqlens:
        for b in batches:
            rows += point(
                device,
                n,
                b,
                args.hit,
                args.block_size,
                args.topk,
                LLAMA3.num_kv_heads,
                LLAMA3.head_dim,
                args.iters,
                args.uva_programs,
                grids,
            )
    record = bench_record(
        "block_copy",
        "experiments.bench.bench_block_copy",
        argv,
        device,
        rows,
        shape={"kv_heads": LLAMA3.num_kv_heads, "head_dim": LLAMA3.head_dim, "block_size": args.block_size},
        hit=args.hit,
        topk=args.topk,
        iters=args.iters,
        uva_programs=args.uva_programs,  # the row gather's; the block copy's default grid is the step's
    )
    write_json_atomic(args.out, record)
    print(f"{len(rows)} rows -> {args.out}")


if __name__ == "__main__":
    main()
