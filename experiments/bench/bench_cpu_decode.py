"""Every system's CPU decode step on real SmolLM2 weights (the target: each within 2x FullAttn's at 8K, so that
the accuracy sweep can run on a CPU).

Per length: one needle prompt, prefilled once (the accuracy backbone's dense prefill), handed to each system in turn
(as experiments.accuracy shares it); then per system `--warmup` untimed greedy steps and `--steps` timed ones, and
optionally `--profile-steps` more under torch.profiler (after the timed ones, so its overhead is not in them): the
operators that took the CPU time. Records ms/step, its ratio to FullAttn's, the phase breakdown, the hit rate, the
generated tokens (two commits that compute the same thing generate the same tokens) and the load average before and
after each system (the machine may be shared).

    python -m experiments.bench.bench_cpu_decode --lengths 2k 8k \
        --out results/investigations/cpu_decode_smollm2/bench.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from experiments.accuracy.backbone import Backbone
from experiments.accuracy.config import compose_config
from experiments.runner.records import environment
from experiments.runner.run_settings import parse_tokens
from experiments.workloads.prompts import needle_prompt
from kvoffload.generate import DecodeStep
from kvoffload.kv.timer import PHASES
from kvoffload.paths import write_json_atomic

SYSTEMS = ("fullattn", "clo", "retroinfer", "infinigen")


def top_ops(prof: torch.profiler.profile, steps: int, rows: int) -> list[dict]:
    """The operators with the most self CPU time, per step."""
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]
    return [
        {
            "op": e.key,
            "self_ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 3),
            "calls_per_step": round(e.count / steps, 1),
        }
        for e in ops
    ]


def run_system(backbone: Backbone, name: str, overrides: list[str], pre, args) -> dict:
    cfg, _ = compose_config([f"system={name}", "device=cpu", *overrides])
    gen = args.warmup + args.steps + args.profile_steps
    system = backbone.system(cfg.system, name, pre.tokens, gen + 1)
    pre.load_into(system)
    step = DecodeStep(backbone.model, system, 1, backbone.device, "eager")
    token = pre.logits.argmax(-1)
    tokens, stats = [int(token)], []
    load_before = os.getloadavg()
    with torch.inference_mode():
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                t0 = time.perf_counter()
            system.begin_step()
            token = step(token)
            s = system.end_step()
            tokens.append(int(token))
            if i >= args.warmup:
                stats.append(s)
        seconds = time.perf_counter() - t0
        ops = None
        if args.profile_steps:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(args.profile_steps):
                    system.begin_step()
                    token = step(token)
                    system.end_step()
            ops = top_ops(prof, args.profile_steps, args.profile_rows)
    lookups = sum(s.lookups for s in stats)
    n = len(stats)
    return {
        "ms_per_step": round(seconds * 1e3 / n, 2),
        "median_step_ms": round(statistics.median(s.phase_ms["total"] for s in stats), 2),
        "step_ms": [round(s.phase_ms["total"], 2) for s in stats],
        "phase_ms_per_step": {p: round(sum(s.phase_ms[p] for s in stats) / n, 2) for p in PHASES},
        "hit_rate": round(sum(s.hits for s in stats) / lookups, 4) if lookups else None,
        "lookups": lookups,
        "tokens": tokens,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "top_ops": ops,
        "plan": {k: v for k, v in system.describe().items() if k != "memory_parts"},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", nargs="+", default=["2k", "8k"], help="prompt tokens (k = 1024)")
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per system")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile-steps", type=int, default=2, help="steps under torch.profiler (0: none)")
    ap.add_argument("--profile-rows", type=int, default=15)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch CPU threads")
    ap.add_argument("--seed", type=int, default=0, help="of the needle prompt")
    ap.add_argument("--override", nargs="*", default=[], help="Hydra overrides for every system (system.eta=0.7)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.profile_steps < 0:
        ap.error("--steps must be at least 1, --warmup and --profile-steps at least 0")
    lengths = [parse_tokens(x, "--lengths") for x in args.lengths]
    torch.set_num_threads(args.threads)

    cfg, _ = compose_config(["system=fullattn", "device=cpu", *args.override])
    backbone = Backbone(cfg)
    out = {
        "command": "python -m experiments.bench.bench_cpu_decode " + " ".join(sys.argv[1:]),
        "environment": environment(backbone.device),
        "torch_threads": torch.get_num_threads(),
        "weights": backbone.weights,
        "dtype": str(backbone.dtype),
        "steps": args.steps,
        "warmup": args.warmup,
        "lengths": {},
    }
    for length in lengths:
        ids = needle_prompt(backbone.tokenizer, length, 1, args.seed, 0.5).tokens[0].tolist()
        with torch.inference_mode():
            pre, _ = backbone.prefill(ids)
        row: dict = {"prefill_s": round(pre.seconds, 2), "systems": {}}
        for name in args.systems:
            r = run_system(backbone, name, args.override, pre, args)
            row["systems"][name] = r
            load = r["loadavg_after"][0]
            print(f"{length:>6} {name:<11} {r['ms_per_step']:8.1f} ms/step  hit {r['hit_rate']}  load {load}")
        full = row["systems"].get("fullattn")
        for r in row["systems"].values():
            r["ratio_to_fullattn"] = round(r["ms_per_step"] / full["ms_per_step"], 2) if full else None
        out["lengths"][str(length)] = row
        write_json_atomic(args.out, out)  # what is finished so far
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
