"""What InfiniGen-style's prefill skew (skew=prefill, the synthetic models' setting) costs a sequence, by where the
eigendecomposition runs: each sparse layer solves one [Hkv, D, D] Gram matrix per sequence (baselines/infinigen.py
prefill_sparse), and torch's CUDA eigh solves such matrices one at a time (cuSOLVER syevj a matrix for D > 32).
Figure 10's InfiniGen-style `fill` stage grows with the batch faster than the other systems' (each record's
`stages`): this measures how much of it the eigh could be, and what the host would take. It times one batch of
Gram matrices by torch.linalg.eigh on the device and on the host (with the host's intra-op threads as set, and with
one), and how far apart the two top-r subspaces lie (the speculation reads only the subspace: q B B^T k).

    python -m experiments.bench.bench_skew_eigh --out skew_eigh.json      # on a GPU
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from experiments.bench.common import bench_record
from experiments.runner.run_settings import resolve_device
from experiments.runner.timing import median_ms
from kvoffload.paths import write_json_atomic


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--matrices", type=int, default=240, help="Gram matrices: a sequence's, 30 sparse layers x 8 heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rank", type=int, default=38, help="kept channels (channel_fraction 0.3 of 128)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(args.matrices, 4 * args.head_dim, args.head_dim, generator=g)
    keys = keys * torch.linspace(3, 0.1, args.head_dim)  # an uneven spectrum, as keys have
    gram = keys.transpose(-1, -2) @ keys

    def top(vecs: torch.Tensor) -> torch.Tensor:
        return vecs[..., -args.rank :].float().cpu()

    gram_dev = gram.to(device)
    on_device, on_host = (lambda: torch.linalg.eigh(gram_dev)[1]), (lambda: torch.linalg.eigh(gram_dev.cpu())[1])
    rows = [{"where": device.type, "threads": None, "s": round(median_ms(on_device, device, args.iters) / 1e3, 4)}]
    host_threads = torch.get_num_threads()
    for n in sorted({host_threads, 1}, reverse=True):
        torch.set_num_threads(n)
        rows.append({"where": "host", "threads": n, "s": round(median_ms(on_host, device, args.iters) / 1e3, 4)})
    torch.set_num_threads(host_threads)
    a, b = top(on_device()), top(on_host())
    gap = ((a @ a.transpose(-1, -2)) - (b @ b.transpose(-1, -2))).norm(dim=(-2, -1)).max().item()
    for r in rows:
        r["ms_per_matrix"] = round(r["s"] * 1e3 / args.matrices, 4)
        print(
            f"{r['where']:<5} threads {r['threads']}: {r['s']:.4f} s for {args.matrices} ({r['ms_per_matrix']} ms each)"
        )
    print(f"largest gap between the two top-{args.rank} projections (Frobenius): {gap:.2e}")
    shape = {"matrices": args.matrices, "head_dim": args.head_dim, "rank": args.rank}
    record = bench_record("skew_eigh", "experiments.bench.bench_skew_eigh", argv, device, rows, shape=shape, gap=gap)
    write_json_atomic(args.out, record)


if __name__ == "__main__":
    main()
