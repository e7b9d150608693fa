"""Launch parameters of the decode-step GEMV (kvoffload/kernels/gemv.py) at Llama-3-8B shapes, BSZ 1, against cuBLAS
(torch's F.linear) in the same run: each projection, every (rows per program, K per load, warps) of the sweep,
replayed from a CUDA graph over enough copies of the weight that none is read from L2 (50 MB on the H200).
Bandwidth = weight bytes / time; the ratio is against the device copy measured in the run. The kernel's
correctness is tests/test_gemv.py's; kvoffload.kernels.gemv.launch_params is chosen from this table.

    python -m experiments.bench.tune_gemv --out results/bench/gemv_tuning.json
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
import torch.nn.functional as F

from experiments.bench.common import DEV, LLAMA3
from experiments.runner.records import environment
from experiments.runner.timing import copy_bandwidth_gb_s, replay_ms
from kvoffload.kernels.dense_ops import silu_mul
from kvoffload.kernels.gemv import gemv_triton, launch_params
from kvoffload.paths import write_json_atomic

SWEEP = list(itertools.product((2, 4, 8, 16), (256, 512, 1024), (4, 8)))


def shapes(cfg) -> dict[str, tuple[int, int, bool]]:
    """name -> (N, K, gated) of a decode step's projections."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    return {
        "qkv": ((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h, False),
        "q (speculative)": (cfg.num_heads * d, h, False),
        "o": (h, cfg.num_heads * d, False),
        "gate_up + silu_mul": (2 * i, h, True),
        "down": (h, i, False),
        "lm_head": (cfg.vocab_size, h, False),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    hbm = copy_bandwidth_gb_s(DEV)
    rows = []
    for name, (n, k, gated) in shapes(LLAMA3).items():
        nbytes = n * k * 2
        copies = max(1, -(-256 * 2**20 // nbytes))  # >= 256 MB in all: each read comes from HBM
        ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(1, 1, k, device=DEV, dtype=torch.bfloat16)

        def timed(kernel: str, one, **params) -> float:
            us = replay_ms(lambda: [one(w) for w in ws], reps=4) * 1e3 / copies
            rows.append(
                {
                    "projection": name,
                    "n": n,
                    "k": k,
                    "kernel": kernel,
                    **params,
                    "us": round(us, 2),
                    "gb_s": round(nbytes / us / 1e3, 1),
                    "of_copy": round(nbytes / us / 1e3 / hbm, 3),
                }
            )
            print(rows[-1], flush=True)
            return us

        # gated: what the decoder did before, one cuBLAS GEMV and then the SiLU-multiply kernel
        timed("cublas", (lambda w: silu_mul(F.linear(x, w))) if gated else (lambda w: F.linear(x, w)))
        timed("triton (default)", lambda w: gemv_triton(x, w, gated=gated), params=list(launch_params(gated)))
        for p in SWEEP:
            timed("triton", lambda w, p=p: gemv_triton(x, w, gated=gated, params=p), params=list(p))
    write_json_atomic(
        args.out,
        {
            "bench": "tune_gemv",
            "model": LLAMA3.name,
            "batch": 1,
            "dtype": "bfloat16",
            "weights": "random (timing only)",
            "hbm_gb_s": round(hbm, 1),
            "rows": rows,
            "environment": environment(DEV),
        },
    )


if __name__ == "__main__":
    main()
