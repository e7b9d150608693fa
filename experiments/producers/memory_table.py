"""Paper Table 6: device memory each offloading system holds for its KV state, by sequence length, measured from
the buffers it really allocates (prefilled with random K/V, no model needed), split into the parts the system
reports. Runs on a CPU: the device buffers are ordinary tensors there, the sizes are the same. Lengths from
--estimate-from on, whose buffers would not fit this machine's RAM, come from the systems' estimate_parts, which
equals the allocated parts (tests/test_system_contract.py, and every measured row here, which records both).

    python -m experiments.producers.memory_table --seqlens 32k,64k,128k,256k,512k --estimate-from 128k \\
        --clo-override system.layer_time_ms=0.164 --clo-override system.link_gb_s=54.6 \\
        --out results/tab6_memory/llama3.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from experiments.runner.records import environment
from experiments.runner.run_settings import parse_tokens
from kvoffload.kv.interface import GB, KVSpec, split_host
from kvoffload.model.config import ModelConfig
from kvoffload.model.rope import rope_frequencies
from kvoffload.paths import ROOT, write_json_atomic

CONF = ROOT / "conf"


def measure(system_name: str, overrides: list[str], seqlen: int, gen: int, estimate_only: bool = False) -> dict:
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"system={system_name}", *overrides])
    mc = ModelConfig.from_mapping(cfg.model)
    system = instantiate(cfg.system)
    cpu = torch.device("cpu")
    spec = KVSpec(
        mc.num_layers,
        1,
        seqlen + gen,
        mc.num_heads,
        mc.num_kv_heads,
        mc.head_dim,
        torch.bfloat16,
        cpu,
        prompt_len=seqlen,
        rope_inv_freq=rope_frequencies(mc),  # ShadowKV-style un-rotates keys before its SVD
    )
    estimate = system.estimate_parts(spec)
    if estimate_only:  # CLO's plan (which heads are persistent) without allocating: plan_for is what allocate uses
        plan = system.plan_for(spec).describe() if hasattr(system, "plan_for") else None
        return row(system_name, seqlen, estimate, split_host(estimate), "estimate_parts", plan)
    system.allocate(spec)
    g = torch.Generator().manual_seed(0)
    for layer in range(mc.num_layers):
        k, v = (
            torch.randn(1, mc.num_kv_heads, seqlen, mc.head_dim, generator=g, dtype=torch.bfloat16) for _ in range(2)
        )
        system.prefill(layer, k, v)
    system.end_prefill(seqlen)
    parts = system.memory_parts()
    described = {k: v for k, v in system.describe().items() if k in ("plan", "importance", "profile")}
    return {
        **row(system_name, seqlen, parts, system.memory_held(), "allocated buffers", described),
        "estimate_equals_buffers": parts == estimate,
    }


def row(system_name: str, seqlen: int, parts: dict, held, source: str, described: dict | None) -> dict:
    return {
        "system": system_name,
        "seqlen": seqlen,
        "source": source,
        "device_gb": round(held.device_bytes / GB, 3),
        "host_gb": round(held.host_bytes / GB, 3),
        "parts_gb": {k: round(v / GB, 4) for k, v in parts.items()},
        "describe": described,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", default="32k,64k")
    ap.add_argument("--systems", default="clo,retroinfer,infinigen")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--estimate-from", default=None, help="from this length on: estimate_parts, no allocation")
    ap.add_argument("--override", action="append", default=[], help="hydra override for every system, repeatable")
    ap.add_argument("--clo-override", action="append", default=[], help="hydra override for clo only, repeatable")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    overrides = ["model=llama3", *args.override]  # the model's own reuse profile, as its speed runs
    rows = []
    estimate_from = parse_tokens(args.estimate_from, "--estimate-from") if args.estimate_from else None
    for seqlen in (parse_tokens(s) for s in args.seqlens.split(",")):
        for name in args.systems.split(","):
            extra = args.clo_override if name == "clo" else []
            estimate_only = estimate_from is not None and seqlen >= estimate_from
            rows.append(measure(name, overrides + extra, seqlen, args.gen, estimate_only))
            print(f"{seqlen:>8} {name:<11} device {rows[-1]['device_gb']:7.3f} GB  host {rows[-1]['host_gb']:7.3f} GB")
    write_json_atomic(
        args.out,
        {
            "table": "device memory of the KV state (paper Tab. 6)",
            "overrides": overrides,
            "clo_overrides": args.clo_override,
            "rows": rows,
            "command": "python -m experiments.producers.memory_table " + " ".join(sys.argv[1:]),
            "environment": environment(torch.device("cpu")),
        },
    )


if __name__ == "__main__":
    main()
