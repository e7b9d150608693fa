"""One sweep run twice on this host: across every GPU (hydra/launcher=gpus, a job per GPU at a time) and on one GPU
(the default launcher, CUDA_VISIBLE_DEVICES set to the pool's first), each into a results folder of its own; the
record gives both wall times, their ratio against the GPU count, and each job's decode tokens/s both ways (jobs
that run side by side share the host's cores, RAM and memory bandwidth, which the host-bound baselines feel).

    python -m experiments.bench.multi_gpu_sweep --out multi_gpu.json --runs <new dir> -- +experiment=fig10_throughput \\
        seqlen=8k batch=1,2,4,8                                            # on a host with several GPUs

--gpus names the pool (default: the visible GPUs, as the launcher takes them); on a host without GPUs a named pool
runs the jobs on the CPU, which only checks the command and the record. --runs must be new or empty: a sweep skips
the points whose records exist, and a comparison of skipped sweeps would time nothing. The launcher needs
hydra-joblib-launcher and joblib (on the GPU machine: their wheels in `.whl/`, `hydra-joblib-launcher==1.2.0
joblib==1.6.0`, docs/scaleout.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from experiments.runner.gpu_assign import visible_gpus
from experiments.runner.records import environment
from kvoffload.paths import write_json_atomic


def run_sweep(overrides: list[str], runs: Path, env: dict[str, str], launcher: list[str]) -> dict:
    """One sweep of experiments.run: its wall time, exit status and its records' decode rates by identity."""
    cmd = [sys.executable, "-m", "experiments.run", "--multirun", *launcher, f"results_dir={runs}"]
    cmd += [f"hydra.sweep.dir={runs}/hydra", *overrides]
    start = time.perf_counter()
    code = subprocess.run(cmd, env=env, check=False).returncode
    wall = time.perf_counter() - start
    jobs = {}
    for path in sorted(runs.glob("*/record.json")):
        rec = json.loads(path.read_text())
        m = rec.get("metrics") or {}
        jobs[" ".join(rec["identity"])] = {"status": rec["status"], "decode_tokens_per_s": m.get("decode_tokens_per_s")}
    return {"command": cmd, "exit": code, "wall_s": round(wall, 2), "jobs": jobs}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", type=Path, required=True, help="the two sweeps' results go to <runs>/all, <runs>/one")
    ap.add_argument("--gpus", default=None, help="the pool, e.g. 0,1,2,3 (default: the visible GPUs)")
    ap.add_argument("overrides", nargs="+", help="the sweep's overrides (after --)")
    args = ap.parse_args(argv)
    gpus = args.gpus.split(",") if args.gpus else visible_gpus()
    problem = None
    if len(gpus) < 2:
        problem = f"multi_gpu_sweep needs a pool of 2 GPUs or more; this host shows {gpus or 'none'}"
    elif args.runs.exists() and any(args.runs.iterdir()):
        problem = f"--runs {args.runs} is not empty: its records would be skipped, not timed; give a new folder"
    elif importlib.util.find_spec("hydra_plugins.hydra_joblib_launcher") is None:
        problem = "hydra/launcher=gpus needs hydra-joblib-launcher and joblib (docs/scaleout.md)"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    env = {**os.environ, "WANDB_SILENT": "true"}
    pool = ["hydra/launcher=gpus", f"hydra.callbacks.one_gpu_per_job.gpus=[{','.join(gpus)}]"]
    pool.append(f"hydra.callbacks.one_gpu_per_job.lock_dir={args.runs / 'locks'}")
    every = run_sweep(args.overrides, args.runs / "all", env, pool)
    if every["exit"] == 2 or not every["jobs"]:  # refused before any job (its error is printed): nothing to compare
        sys.exit(every["exit"] or 2)
    one = run_sweep(args.overrides, args.runs / "one", {**env, "CUDA_VISIBLE_DEVICES": gpus[0]}, [])
    speedup = one["wall_s"] / max(every["wall_s"], 1e-3)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    record = {
        "bench": "multi_gpu_sweep",
        "gpus": gpus,
        "overrides": args.overrides,
        "every_gpu": every,
        "one_gpu": one,
        "speedup": round(speedup, 3),
        "speedup_of_ideal": round(speedup / len(gpus), 3),
        "environment": environment(device),
    }
    write_json_atomic(args.out, record)
    print(
        f"{len(every['jobs'])} jobs: {every['wall_s']:.1f} s over {len(gpus)} GPUs, {one['wall_s']:.1f} s on one "
        f"({speedup:.2f}x, {speedup / len(gpus):.2f} of {len(gpus)}x) -> {args.out}"
    )
    sys.exit(max(every["exit"], one["exit"]))


if __name__ == "__main__":
    main()
