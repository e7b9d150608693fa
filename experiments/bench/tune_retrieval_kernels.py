"""Launch parameters of the retrieval kernels on the critical path of a CLO layer, timed at Llama-3-8B shape,
128K (BSZ 1): the query encoding (CHUNK of head_dim per step), the hash scores (tokens per program, warps) and
the radix top-k (keys per program, warps), each for the 6 cached and 2 persistent KV heads of a median layer;
an ascending select (a sort after it, or its ordered last pass) at RetroInfer-style's block and token counts, and
at InfiniGen-style's (bf16 scores: torch.topk and a sort, or the radix select of the widened scores).
The scores and the select are also timed together, with the select's first pass counted by the scores' kernel or
by a pass of its own. The defaults in kvoffload/kernels/ are chosen from this table; the kernels' correctness is
tests/test_clo_select_kernels.py's.

    python -m experiments.bench.tune_retrieval_kernels --out results/bench/retrieval_tuning.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from experiments.bench.common import DEV, LLAMA3
from experiments.runner.records import environment
from experiments.runner.timing import copy_bandwidth_gb_s, replay_ms
from kvoffload.kernels.hash_score import encode_query_triton, hash_scores_triton
from kvoffload.kernels.radix_keys import radix_work
from kvoffload.kernels.radix_topk import radix_topk, topk_indices
from kvoffload.paths import write_json_atomic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seqlen", type=int, default=131072)
    args = ap.parse_args()
    t, hkv, g, d, rbit = args.seqlen, LLAMA3.num_kv_heads, LLAMA3.group_size, LLAMA3.head_dim, 256
    k = (t + 9) // 10
    gen = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(1, hkv * g, d, device=DEV, dtype=torch.bfloat16, generator=gen)
    proj = torch.randn(hkv, d, rbit, device=DEV, generator=gen)
    codes = torch.randint(0, 256, (1, hkv, t, rbit // 8), device=DEV, dtype=torch.uint8, generator=gen)
    norms = torch.rand(1, hkv, t, device=DEV, generator=gen)
    hbm = copy_bandwidth_gb_s(DEV) * 1e3  # bytes per microsecond
    rows = []

    def timed(kernel: str, heads: int, floor_bytes: int, fn, **params) -> None:
        us = replay_ms(fn, reps=20) * 1e3
        rows.append(
            {"kernel": kernel, "heads": heads, **params, "us": round(us, 2), "floor_us": round(floor_bytes / hbm, 2)}
        )
        print(rows[-1], flush=True)

    for h in (6, 2):
        heads = torch.arange(h, device=DEV)
        for chunk in (16, 32, 64, 128):
            timed(
                "encode_query", h, proj[:h].nbytes, lambda: encode_query_triton(q, proj, heads, g, chunk), chunk=chunk
            )
        qcodes = encode_query_triton(q, proj, heads, g)
        for block_t in (256, 512, 1024, 2048):
            for warps in (4, 8):
                timed(
                    "hash_scores",
                    h,
                    h * t * (rbit // 8 + 4 + 4),
                    lambda: hash_scores_triton(codes, norms, qcodes, rbit, heads, block_t, warps),
                    block_t=block_t,
                    num_warps=warps,
                )
        # scores then select, the select's first pass counted by the scores' kernel (CLO's) or by its own pass
        for block_t in (256, 1024):
            for counted in (False, True):

                def scores_then_select():
                    work = radix_work(h, codes.device) if counted else None
                    s = hash_scores_triton(codes, norms, qcodes, rbit, heads, block_t, hist=work)[0]
                    return radix_topk(s, k, work=work)

                timed(
                    "hash_scores + radix_topk",
                    h,
                    h * t * (rbit // 8 + 4 + 4 + 4 * (5 - counted)) + h * k * 8,
                    scores_then_select,
                    block_t=block_t,
                    first_pass_counted=counted,
                )
        scores = hash_scores_triton(codes, norms, qcodes, rbit, heads)[0]  # [h, T]: one row per head
        for block in (2048, 4096, 8192, 16384):
            for warps in (4, 8, 16):
                timed(
                    "radix_topk",
                    h,
                    h * t * 4 * 5 + h * k * 8,  # five reads of the scores, the indices written
                    lambda: radix_topk(scores, k, block=block, num_warps=warps),
                    block=block,
                    num_warps=warps,
                )
    # an ascending select (RetroInfer-style's LRU takes its ids ascending): the select then a sort, against the
    # select's ordered last pass, for its block selection (a block per 8 tokens) and its token selection
    for label, n, kk in (("blocks", t // 8, k // 8), ("tokens", t, k)):
        s8 = torch.randn(hkv, n, device=DEV, generator=gen)
        floor = hkv * n * 4 * 5 + hkv * kk * 8
        timed("radix_topk + sort", hkv, floor, lambda: radix_topk(s8, kk).sort(-1).values, select=label)
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8):
                timed(
                    "radix_topk ordered",
                    hkv,
                    floor,
                    lambda: radix_topk(s8, kk, block=block, num_warps=warps, ordered=True),
                    select=label,
                    block=block,
                    num_warps=warps,
                )
    # InfiniGen-style's select: bf16 partial scores over the tokens, ascending for its CPU gather; torch.topk and a
    # sort (its default) against the radix select of the widened scores
    s16 = torch.randn(hkv, t, device=DEV, generator=gen).to(torch.bfloat16)
    floor = hkv * t * 2 + hkv * k * 8
    timed("torch.topk + sort (bf16)", hkv, floor, lambda: s16.topk(k, dim=-1, sorted=False).indices.sort(-1).values)
    timed("topk_indices ordered (bf16)", hkv, floor, lambda: topk_indices(s16, k, ordered=True))
    write_json_atomic(
        args.out,
        {
            "bench": "tune_retrieval_kernels",
            "seqlen": t,
            "k": k,
            "rbit": rbit,
            "weights": "random codes, norms, projections and queries (timing only)",
            "hbm_gb_s": round(hbm / 1e3, 1),
            "rows": rows,
            "environment": environment(DEV),
        },
    )


if __name__ == "__main__":
    main()
