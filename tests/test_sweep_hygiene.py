"""Each job of a sweep starts from the memory the previous one had: what a job allocated is released before the
next plans its memory (experiments.run.release_memory, run after every job)."""

import gc
import json
import subprocess
import sys
import weakref

import pytest
import torch

from experiments.run import release_memory
from kvoffload.kv.interface import KVSpec
from kvoffload.paths import ROOT


def test_release_memory_frees_a_finished_jobs_system():
    from clo.system import CLO

    gc.disable()  # as if the collector had not run since the job: only release_memory may free the cycle
    try:
        system = CLO(retriever="exact", dense_layers=0, persistent=False, speculative=False)
        system.allocate(KVSpec(2, 1, 64, 4, 2, 8, torch.float32, torch.device("cpu")))
        system.self_ref = system  # a reference cycle, as a model and its system hold
        alive = weakref.ref(system)
        del system
        assert alive() is not None
        release_memory()
        assert alive() is None
    finally:
        gc.enable()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["inline", "fork"])
def test_consecutive_sweep_jobs_start_with_the_same_free_device_memory(tmp_path, mode):
    """inline: release_memory between jobs; fork: each job a child of a sweep process that never touched CUDA (had
    it initialised the driver, no child's CUDA would start)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cmd = [
        sys.executable,
        "-m",
        "experiments.run",
        "--multirun",
        "model.weights=synthetic",
        "seqlen=4k",
        "workload.gen_tokens=4",
        "wandb.enabled=false",
        f"results_dir={tmp_path}",
        "system=clo,fullattn,clo",
        f"job_process={mode}",
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    recs = [json.loads(p.read_text()) for p in tmp_path.glob("*/record.json")]
    assert [r["status"] for r in recs] == ["ok", "ok"]
    free = [r["environment"]["device_free_gb_at_start"] for r in recs]
    assert len(free) == 2  # the third job is the first one again: skipped
    assert abs(free[0] - free[1]) < 0.01 * max(free), free
