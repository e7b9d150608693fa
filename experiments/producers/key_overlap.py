"""Adjacent-step overlap of the synthetic workload at any model's shape, offline (no model, no KV system): what a
block cache can hit at paper shapes with synthetic keys (projection-like isotropic keys and a random first query,
or the key process's keys and first query), by the measures of experiments/producers/key_profile.py.

    python -m experiments.producers.key_overlap --keys data/profiles/llama3-keys-from-smollm2.json \\
        --queries data/profiles/llama3-from-smollm2-reuse.json --heads 32 --tokens 4096 --steps 32
"""

from __future__ import annotations

import argparse

import torch

from experiments.producers.key_profile import BLOCK, BUDGET, adjacent_overlap, process_queries
from experiments.workloads.key_process import KeyProcess, load_fields
from experiments.workloads.query_process import ProfileQueryProcess
from kvoffload.offload.budget import select_budget


def overlaps(keys: KeyProcess, queries: str, heads: int, tokens: int, steps: int, seed: int) -> dict[str, float]:
    """Means over layers 2.. of token and block top-k overlap, for isotropic keys with a random first query (what
    kv_fill=projection gives) and for the key process's keys and first query (kv_fill=key_process)."""
    torch.manual_seed(seed)
    layers, hkv, d = keys.shape
    group = heads // hkv
    proc = ProfileQueryProcess.from_profile(queries, layers, hkv, group, torch.device("cpu"))
    k = select_budget(tokens, BUDGET["topk_ratio"], BUDGET["sink"], BUDGET["recent"])
    sums = {f"{w}/{m}": 0.0 for w in ("projection_like", "key_process") for m in ("token", "block")}
    for i in range(2, layers):
        q_rand = torch.randn(heads, d)
        runs = {
            "projection_like": (torch.randn(hkv, tokens, d), q_rand),
            "key_process": (
                keys.sample(i, tokens, torch.device("cpu"), torch.float32),
                keys.first_query(i, q_rand[None])[0],
            ),
        }
        for name, (kk, q0) in runs.items():
            q = process_queries(proc, i, q0, steps).unflatten(1, (hkv, group)).transpose(0, 1)  # [Hkv, S, G, D]
            for h in range(hkv):
                sums[f"{name}/token"] += adjacent_overlap(kk[h], q[h], k) / (hkv * (layers - 2))
                sums[f"{name}/block"] += adjacent_overlap(kk[h], q[h], k, BLOCK) / (hkv * (layers - 2))
    return {name: round(v, 4) for name, v in sums.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", required=True, help="a key profile (data/profiles/*-keys*.json)")
    ap.add_argument("--queries", required=True, help="a query-process profile of the same shape")
    ap.add_argument("--heads", type=int, required=True, help="query heads per layer")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    fields = load_fields(args.keys)
    keys = KeyProcess(fields, args.seed, args.keys)
    for name, v in overlaps(keys, args.queries, args.heads, args.tokens, args.steps, args.seed).items():
        print(f"{name:>24}: {v:.3f}")


if __name__ == "__main__":
    main()
