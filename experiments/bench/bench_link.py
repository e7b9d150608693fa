"""Paper Figures 3 and 13: the host -> device bandwidth each transfer path reaches, by transfer volume and by CPU
thread count, against a bulk pinned copy of the same bytes measured in the same run.

A volume of T tokens is T selected rows of every KV head of one layer (Llama-3-8B shapes by default: 8 KV heads,
512 B rows of K and V), picked at random among T / fraction rows of the head (the top-k share of a context of
T / fraction tokens), as a layer's top-k lies in the host store. Paths, through kvoffload/offload/transfer.py:

  bulk        one contiguous pinned copy of the same bytes (the link's ceiling)
  uva         the GPU-initiated zero-copy gather (no CPU thread; CUDA only)
  cpu_gather  CPU gather into pinned staging by N threads, then one copy (the baselines' path), N in --threads

On a CPU device there is no link: `bulk` is a host copy and `cpu_gather` the engine's host reference gather, whose
thread count does not apply (its rows carry threads null); that run only checks the command and the record.

With --link-gb-s (hardware.link_gb_s; docs/gpu.md, "A slower link") the sweep runs again at each cap with every path
paced to it (kvoffload/offload/link.py), each row with its cap and the achieved rate's share of it (`of_cap`); a cap
above the bulk copy measured unpaced at the start is refused, as the run command refuses it.

    python -m experiments.bench.bench_link --out results/fig3_13_link/record.json        # on a GPU
    python -m experiments.bench.bench_link --link-gb-s 8,16,21.21,32 --threads 8 --out link_cap.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from experiments.bench.common import LLAMA3, bench_record, counts, sweep
from experiments.runner.run_settings import check_link_cap, number, parse_tokens, resolve_device
from experiments.runner.timing import pinned_h2d_gb_s
from kvoffload.errors import ConfigError
from kvoffload.offload.link import MECHANISM, shared_pacer
from kvoffload.paths import write_json_atomic


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
    ap.add_argument("--link-gb-s", default="", help="caps (GB/s) to pace every path to, e.g. 8,16,21.21,32")
    args = ap.parse_args(argv)
    try:
        tokens = counts(args.tokens, "tokens", parse_tokens)
        threads = counts(args.threads, "threads")
        if not 0 < args.fraction <= 1:
            raise ConfigError(f"--fraction {args.fraction}: must be in (0, 1]")
        device = resolve_device(args.device)
        caps = [number(c, "--link-gb-s", 0.0, above=True) for c in args.link_gb_s.split(",") if c.strip()]
        for cap in caps:
            check_link_cap(cap, device)  # a CPU run has no link to cap
        bulk = pinned_h2d_gb_s(device) if caps else None  # the link unpaced, which no cap may exceed
        for cap in caps:
            check_link_cap(cap, device, bulk)
    except ConfigError as e:
        msg = str(e).replace("set hardware.link_gb_s=null", "leave out --link-gb-s")
        print(f"error: {msg.replace('hardware.link_gb_s', '--link-gb-s')}", file=sys.stderr)
        sys.exit(2)
    shape = (args.kv_heads, args.head_dim, args.fraction, args.iters, args.uva_programs)
    rows = sweep(device, tokens, threads, *shape, pacers=[None, *(shared_pacer(device, c) for c in caps)])
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
        link_caps_gb_s=caps,
        bulk_unpaced_gb_s=None if bulk is None else round(bulk, 2),
        mechanism=MECHANISM if caps else None,
    )
    write_json_atomic(args.out, record)
    print(f"{len(rows)} rows -> {args.out}")


if __name__ == "__main__":
    main()
