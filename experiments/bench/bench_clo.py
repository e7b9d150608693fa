"""CLO's mechanisms on the GPU, each next to its physical limit, all variants in one run:

transfer  scattered 256 B / 512 B rows (10% of a 512 MiB pinned pool) moved by the GPU-initiated UVA gather
          (zero CPU threads; several caps on its grid) and by CPU gather + copy with 1/4/16 threads, against
          a pinned bulk copy of the same bytes measured in the same run
lookup    the fused lookup + label update at Llama-3-8B shape, against one layer's dense compute time
retrieval hash scoring (256-bit codes) and top-k (torch.topk and the radix select) at 128K, against their
          memory floor

  python -m experiments.bench.bench_clo --out results/bench/clo_mechanisms.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from experiments.bench.common import DEV, LLAMA3, UVA_PROGRAMS, time_ms
from experiments.runner.records import environment
from experiments.runner.timing import copy_bandwidth_gb_s, layer_time_s, replay_ms
from kvoffload.kernels.hash_score import hash_scores
from kvoffload.kernels.head_cache import lookup_and_update
from kvoffload.kernels.radix_topk import topk_indices, topk_ref
from kvoffload.kernels.uva_gather import gather_rows_ref, uva_gather
from kvoffload.model.decoder import Layer
from kvoffload.offload.transfer import TransferEngine
from kvoffload.paths import write_json_atomic


def bench_transfer(pool_bytes: int = 512 << 20, fraction: float = 0.1) -> list[dict]:
    rows_out = []
    for row_bytes in (256, 512):
        d = row_bytes // 4  # K and V of one token, bf16
        t = pool_bytes // row_bytes
        host = torch.randn(1, 1, t, 2, d, dtype=torch.bfloat16).pin_memory()
        k = int(t * fraction)
        idx = torch.randperm(t, device=DEV)[:k].sort().values.view(1, 1, k)
        heads, miss = torch.zeros(1, dtype=torch.long, device=DEV), torch.ones(1, 1, dtype=torch.bool, device=DEV)
        slots = torch.zeros(1, 1, k, 2, d, dtype=torch.bfloat16, device=DEV)
        nbytes = k * row_bytes
        bulk_src = host.view(-1)[: nbytes // 2]
        bulk_dst = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=DEV)
        bulk_ms = time_ms(lambda: bulk_dst.copy_(bulk_src, non_blocking=True), iters=20)
        bulk = nbytes / bulk_ms / 1e6

        def measured(path: str, ms: float, **extra) -> dict:
            gb_s = nbytes / ms / 1e6
            return {
                "row_bytes": row_bytes,
                "rows": k,
                "path": path,
                "gb_s": round(gb_s, 1),
                "of_bulk": round(gb_s / bulk, 3),
                "bulk_gb_s": round(bulk, 1),
                **extra,
            }

        for programs in UVA_PROGRAMS:
            slots.zero_()
            uva_ms = time_ms(lambda: uva_gather(host, heads, idx, miss, slots, programs=programs), iters=20)
            exact = torch.equal(slots.cpu(), gather_rows_ref(host, heads.cpu(), idx.cpu()))
            rows_out.append(measured(f"uva (0 CPU threads, {programs} programs)", uva_ms, exact_rows=exact))
        for threads in (1, 4, 16):
            eng = TransferEngine("cpu_gather", threads, DEV)
            ms = time_ms(lambda: eng.fill(host, heads, idx, miss, slots), iters=5)
            rows_out.append(measured(f"cpu_gather {threads} threads", ms))
        for r in rows_out[-3 - len(UVA_PROGRAMS) :]:
            print(
                f"transfer {r['row_bytes']:>4} B rows  {r['path']:<22} {r['gb_s']:7.1f} GB/s"
                f" = {r['of_bulk']:.2f} of bulk"
            )
    return rows_out


def layer_ms(batch: int = 1) -> float:
    """One Llama-3-8B layer's dense work at decode, replayed from a graph (what the runner measures)."""
    return layer_time_s(Layer(LLAMA3).to(DEV, torch.bfloat16), batch) * 1e3


def bench_lookup(layer_time: float, batch: int = 1) -> dict:
    b, hc, g, d = batch, 8, 4, 128
    q = torch.randn(b, hc, g, d, device=DEV, dtype=torch.bfloat16)
    labels = torch.randn(b, hc, g, d, device=DEV)
    valid = torch.ones(b, hc, dtype=torch.bool, device=DEV)
    tau, w = torch.full((hc,), 0.8, device=DEV), torch.ones(hc, g, device=DEV)
    force = torch.zeros(hc, dtype=torch.bool, device=DEV)
    ms = replay_ms(lambda: lookup_and_update(q, labels, valid, tau, w, force, "mean"), reps=100)
    out = {
        "lookup_us": round(ms * 1e3, 2),
        "layer_us": round(layer_time * 1e3, 1),
        "fraction_of_layer": round(ms / layer_time, 4),
    }
    print(
        f"lookup+label update {out['lookup_us']} us = {out['fraction_of_layer'] * 100:.2f}% of a"
        f" {out['layer_us']} us layer"
    )
    return out


def bench_retrieval(tokens: int = 131072, hkv: int = 8, g: int = 4, rbit: int = 256) -> dict:
    codes = torch.randint(0, 256, (1, hkv, tokens, rbit // 8), dtype=torch.uint8, device=DEV)
    norms = torch.rand(1, hkv, tokens, device=DEV)
    qcodes = torch.randint(0, 256, (1, hkv, g, rbit // 8), dtype=torch.uint8, device=DEV)
    bw = copy_bandwidth_gb_s(DEV)
    score_ms = replay_ms(lambda: hash_scores(codes, norms, qcodes, rbit))
    scores = hash_scores(codes, norms, qcodes, rbit)
    topk_ms = replay_ms(lambda: topk_ref(scores, tokens // 10), reps=10)
    radix_ms = replay_ms(lambda: topk_indices(scores, tokens // 10), reps=10)
    floor = (codes.nbytes + norms.nbytes + scores.nbytes) / (bw * 1e9) * 1e3
    out = {
        "tokens": tokens,
        "hash_score_us": round(score_ms * 1e3, 1),
        "floor_us": round(floor * 1e3, 1),
        "torch_topk_us": round(topk_ms * 1e3, 1),
        "radix_topk_us": round(radix_ms * 1e3, 1),
        "topk_floor_us": round(5 * scores.nbytes / (bw * 1e9) * 1e6, 1),
    }  # radix select reads the scores 5 times
    print(
        f"hash scoring {tokens} tokens x {hkv} heads: {out['hash_score_us']} us (floor {out['floor_us']} us); "
        f"top-10% torch.topk {out['torch_topk_us']} us, radix select {out['radix_topk_us']} us"
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    layer_time = layer_ms()
    data = {
        "bench": "clo_mechanisms",
        "transfer": bench_transfer(),
        "lookup": bench_lookup(layer_time),
        "retrieval": bench_retrieval(),
        "environment": environment(DEV),
    }
    write_json_atomic(args.out, data)


if __name__ == "__main__":
    main()
