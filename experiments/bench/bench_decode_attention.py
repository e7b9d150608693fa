"""Benchmark: one layer of full decode attention (Llama-3-8B shape by default) for every kernel FullAttn can use, at
every batch and length, in one run, each next to its HBM floor (K+V bytes / device copy bandwidth measured in the
same run). Graph rows are the GPU's own time (the call replayed from a CUDA graph, as FullAttn's captured step
runs it); eager rows include the host's launch overhead. flashinfer's batch decode is planned once per length
outside the graph, as FullAttn plans it once per step; its host planning time is reported beside it.

    python -m experiments.bench.bench_decode_attention --batches 1,2,4,8,16 --lengths 32k,64k,128k \\
        --out results/bench/decode_attention.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from baselines.fullattn import dense_decode_attention
from baselines.paged_decode import PagedDecode, flashinfer_module
from experiments.bench.common import time_ms
from experiments.runner.records import environment
from experiments.runner.run_settings import parse_tokens
from experiments.runner.timing import copy_bandwidth_gb_s, replay_ms
from kvoffload.kernels.decode_attention import decode_attention_triton
from kvoffload.paths import write_json_atomic


def kernels(q, k, v, lengths, length: int) -> dict:
    """name -> (mode, fn) for one shape. k, v [B, T, Hkv, D] (T a multiple of the page size)."""
    b, h, d = q.shape
    hkv = k.shape[2]
    kt, vt = k[:, :length].transpose(1, 2), v[:, :length].transpose(1, 2)
    out = {
        "triton (ours)": ("graph", lambda: decode_attention_triton(q, k, v, lengths)),
        "torch sdpa (GQA folded)": ("eager", lambda: dense_decode_attention(q, kt, vt)),
    }
    fi = flashinfer_module()
    if fi is None:
        return out
    for cores in (False, True):
        paged = PagedDecode(b, k.shape[1], h, hkv, d, q.dtype, q.device, graph=True, tensor_cores=cores)
        t = time.perf_counter()
        paged.plan(length)
        torch.cuda.synchronize()
        paged.plan_host_ms = (time.perf_counter() - t) * 1e3
        name = "flashinfer batch decode" + (" tensor cores" if cores else "")
        out[name] = ("graph", lambda p=paged: p.run(q, k, v), paged)
    out["flashinfer single_decode loop"] = (
        "eager",
        lambda: [fi.single_decode_with_kv_cache(q[i], k[i, :length], v[i, :length], kv_layout="NHD") for i in range(b)],
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="32k,128k")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth_gb_s(dev)
    rows = []
    for length in (parse_tokens(x) for x in args.lengths.split(",")):
        for b in (int(x) for x in args.batches.split(",")):
            h, hkv, d = args.heads, args.kv_heads, args.head_dim
            q = torch.randn(b, h, d, device=dev, dtype=torch.bfloat16)
            k = torch.randn(b, -(-length // 16) * 16, hkv, d, device=dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            lengths = torch.full((b,), length, device=dev)
            nbytes = 2 * b * length * hkv * d * k.element_size()
            floor = nbytes / (bw * 1e9) * 1e3
            for name, (mode, fn, *paged) in kernels(q, k, v, lengths, length).items():
                ms = replay_ms(fn) if mode == "graph" else time_ms(fn)
                row = {"length": length, "batch": b, "kernel": name, "mode": mode, "ms": round(ms, 4)}
                row |= {"floor_ms": round(floor, 4), "x_floor": round(ms / floor, 3)}
                row["achieved_gb_s"] = round(nbytes / ms / 1e6, 1)
                if paged:
                    row["plan_host_ms"] = round(paged[0].plan_host_ms, 3)
                rows.append(row)
                print(
                    f"{length:>8} B{b:<3} {name:<36} {mode:<6} {ms * 1e3:8.1f} us  floor {floor * 1e3:7.1f} us  "
                    f"{ms / floor:5.2f}x"
                )
            del q, k, v
            torch.cuda.empty_cache()
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
