"""Benchmark: one layer of full decode attention (Llama-3-8B shape by default) for every backend, in one run,
each next to its HBM floor (K+V bytes / device copy bandwidth measured in the same run).

    python -m experiments.bench_decode_attention --out results/bench/decode_attention.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from baselines.fullattn import dense_decode_attention
from experiments.preflight import parse_tokens
from experiments.records import environment
from experiments.timing import copy_bandwidth_gb_s, median_ms
from kvoffload.kernels.decode_attention import decode_attention_triton
from kvoffload.paths import write_json_atomic


def time_ms(fn, iters: int = 50) -> float:
    """Median of `iters` eager calls, launch overhead included (what an eager caller pays)."""
    return median_ms(fn, torch.device("cuda"), iters, warmup=5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="32k,128k")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth_gb_s(dev)
    rows = []
    for length in (parse_tokens(x) for x in args.lengths.split(",")):
        b, h, hkv, d = args.batch, args.heads, args.kv_heads, args.head_dim
        q = torch.randn(b, h, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, length, hkv, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lengths = torch.full((b,), length, device=dev)
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)
        backends = {
            f"triton (ours) block {bn} warps {w}": (lambda bn=bn, w=w: decode_attention_triton(q, k, v, lengths, bn, w))
            for bn in (64, 128)
            for w in (4, 8)
        }
        backends["torch sdpa (GQA folded)"] = lambda: dense_decode_attention(q, kt, vt)
        try:
            import flashinfer

            backends["flashinfer single_decode (NHD)"] = lambda: [
                flashinfer.single_decode_with_kv_cache(q[i], k[i], v[i], kv_layout="NHD") for i in range(b)
            ]
        except ImportError:
            pass
        nbytes = 2 * k.numel() * k.element_size()
        floor = nbytes / (bw * 1e9) * 1e3
        for name, fn in backends.items():
            ms = time_ms(fn)
            rows.append(
                {
                    "length": length,
                    "batch": b,
                    "backend": name,
                    "ms": round(ms, 4),
                    "floor_ms": round(floor, 4),
                    "x_floor": round(ms / floor, 3),
                    "achieved_gb_s": round(nbytes / ms / 1e6, 1),
                }
            )
            print(f"{length:>8} {name:<36} {ms * 1e3:8.1f} us  floor {floor * 1e3:7.1f} us  {ms / floor:5.2f}x")
    write_json_atomic(
        args.out,
        {
            "bench": "decode_attention",
            "copy_bandwidth_gb_s": round(bw, 1),
            "shape": vars(args) | {"out": str(args.out)},
            "rows": rows,
            "environment": environment(dev),
        },
    )


if __name__ == "__main__":
    main()
