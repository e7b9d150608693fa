"""What the synthetic query process (experiments/workloads/query_process.py) costs a decode step on its own.

Speed runs on synthetic weights pass every layer's query through this process inside the timed step, for every
system: it is the workload's cost, not a system's, and a real model pays nothing for it. This bench times one
step's worth of its calls (every layer, as Decoder.attention_queries issues them) by batch, replayed from a CUDA
graph (as CLO's and FullAttn's whole steps and the baselines' piecewise dense segments replay it) and launched
eagerly, as torch code (some thirty kernels a call) and in one launch a call (kvoffload.kernels.query_chain, the
default on CUDA). `speculative`: the calls of a system that wants a one-layer-ahead query (CLO, InfiniGen-style),
which perturbs a second query per layer; the others (FullAttn, RetroInfer-style) make one call per layer.

    python -m experiments.bench.bench_query_process --out results/.../query_process.json   # on the GPU machine
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

from experiments.bench.common import LLAMA3, counts
from experiments.runner.records import environment, refuse
from experiments.runner.timing import median_ms, replay_ms
from experiments.workloads.query_process import ProfileQueryProcess
from kvoffload.errors import ConfigError
from kvoffload.paths import write_json_atomic

# the shape timed, as the record names it: Llama-3-8B's
SHAPE = {
    "layers": LLAMA3.num_layers,
    "heads": LLAMA3.num_heads,
    "kv_heads": LLAMA3.num_kv_heads,
    "head_dim": LLAMA3.head_dim,
}
PROFILE = "data/profiles/llama3-from-smollm2-reuse.json"  # conf/model/llama3.yaml's synthetic_queries


def one_step(process: ProfileQueryProcess, q: torch.Tensor, layers: int, speculative: bool) -> None:
    """The process's calls of one decode step, in Decoder.attention_queries's order."""
    for i in range(layers):
        if speculative and i + 1 < layers:
            process.query(i + 1, q, advance=True, speculative=True)
        process.query(i, q, advance=not (speculative and i > 0))


def kernels_per_step(fn) -> int:
    """CUDA kernels one eager step launches (profiler count)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def measure(batch: int, speculative: bool, fused: bool, device: torch.device, iters: int) -> dict:
    shape = SHAPE
    process = ProfileQueryProcess.from_profile(
        PROFILE, shape["layers"], shape["kv_heads"], shape["heads"] // shape["kv_heads"], device, fused=fused
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(batch, shape["heads"], shape["head_dim"], device=device, dtype=dtype)
    step = lambda: one_step(process, q, shape["layers"], speculative)  # noqa: E731
    for _ in range(3):  # the first call of a layer draws its state; later calls advance it in place
        step()
    row = {"batch": batch, "speculative": speculative, "fused": process.fused}
    row["eager_ms"] = round(median_ms(step, device, repeats=iters), 4)
    if device.type == "cuda":
        row["kernels_per_step"] = kernels_per_step(step)
        row["graph_ms"] = round(replay_ms(step), 4)  # median of 10 replays of a 20-step graph, per step
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,2,4,8,16,32,64")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        batches = counts(args.batches, "batches")
        if args.iters < 1:
            raise ConfigError(f"--iters {args.iters}: must be at least 1")
    except ConfigError as e:
        refuse(e)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for batch in batches:
        for speculative in (False, True):
            for fused in (False, True) if device.type == "cuda" else (False,):
                rows.append(measure(batch, speculative, fused, device, args.iters))
                print(rows[-1], flush=True)
    command = "python -m experiments.bench.bench_query_process " + shlex.join(sys.argv[1:] if argv is None else argv)
    write_json_atomic(
        args.out,
        {
            "bench": "query_process",
            "command": command,
            "profile": PROFILE,
            "shape": SHAPE,
            "rows": rows,
            "environment": environment(device),
        },
    )


if __name__ == "__main__":
    main()
