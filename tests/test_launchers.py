"""The sweep launchers: Slurm (one GPU per job, the sbatch script submitit would submit) and one host's GPUs (a
worker per GPU, each pinned to its own, jobs waiting rather than sharing one; a real joblib sweep on fake GPU ids,
whose records, skip-if-done and end-of-sweep table are the default launcher's). No GPU or Slurm here: these check
the configuration and the assignment, not a run on a device."""

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from experiments.runner import gpu_assign
from experiments.runner.gpu_assign import claim, release, reserve, visible_gpus

ROOT = Path(__file__).resolve().parent.parent


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def test_the_default_launcher_is_hydras_basic_one():
    cfg = composed()
    assert cfg.hydra.runtime.choices["hydra/launcher"] == "basic"
    assert "one_gpu_per_job" not in cfg.hydra.callbacks


# ---- Slurm -----------------------------------------------------------------------------------------------------
def test_slurm_submits_one_gpu_per_job_to_the_partition_given(tmp_path, monkeypatch):
    pytest.importorskip(
        "hydra_plugins.hydra_submitit_launcher", reason="hydra-submitit-launcher is not installed (the `slurm` extra)"
    )
    import submitit
    from hydra.utils import instantiate

    cfg = composed("hydra/launcher=slurm", "hydra.launcher.partition=gpu-a100", f"hydra.sweep.dir={tmp_path}")
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher") and launcher.partition == "gpu-a100"
    assert (launcher.gpus_per_node, launcher.tasks_per_node, launcher.nodes) == (1, 1, 1)

    class Script(Exception):
        pass

    class Recording(submitit.AutoExecutor):  # renders the sbatch script the launcher would submit, submits nothing
        def map_array(self, fn, *args):
            raise Script(self._executor._make_submission_file_text("<the job>", "uid"))

    monkeypatch.setattr(submitit, "AutoExecutor", Recording)
    fake = tmp_path / "bin"  # submitit's Slurm executor checks that srun exists
    fake.mkdir()
    (fake / "srun").write_text("#!/bin/sh\nexit 1\n")
    (fake / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    plugin = instantiate(launcher)
    plugin.setup(hydra_context=None, task_function=None, config=cfg)
    with pytest.raises(Script) as script:
        plugin.launch([["seqlen=4k"], ["seqlen=32k"]], initial_job_idx=0)
    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)$", str(script.value), re.M))
    assert sbatch["partition"] == "gpu-a100" and sbatch["gpus-per-node"] == "1"
    assert sbatch["ntasks-per-node"] == "1" and sbatch["nodes"] == "1"
    assert sbatch["time"] == str(launcher.timeout_min) and sbatch["cpus-per-task"] == str(launcher.cpus_per_task)


# ---- one host's GPUs: the assignment -----------------------------------------------------------------------------
def test_the_pool_is_cuda_visible_devices_else_nvidia_smi(monkeypatch):
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 5"}) == ["2", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []  # set but empty: no GPU, whatever nvidia-smi says
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi
    assert visible_gpus({}) == []


def test_n_jobs_is_the_pools_size(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    cfg = composed("hydra/launcher=gpus")
    assert cfg.hydra.launcher._target_.endswith("JoblibLauncher") and cfg.hydra.launcher.n_jobs == 3
    assert cfg.hydra.callbacks.one_gpu_per_job._target_ == "experiments.runner.gpu_assign.OneGpuPerJob"
    assert "sweep_summary" in cfg.hydra.callbacks  # the default launcher's table, too
    assert composed("hydra/launcher=gpus", "hydra.callbacks.one_gpu_per_job.gpus=[0,2]").hydra.launcher.n_jobs == 2


def in_thread(fn, *args):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("v", fn(*args)), daemon=True)
    t.start()
    return t, out


def test_n_jobs_on_n_gpus_get_distinct_devices_and_the_rest_wait(tmp_path):
    gpus = ["0", "1"]
    a, b = claim(gpus, tmp_path, poll_s=0.01), claim(gpus, tmp_path, poll_s=0.01)
    assert {a.gpu, b.gpu} == {"0", "1"}
    t, out = in_thread(claim, gpus, tmp_path, None, 0.01)
    t.join(0.3)
    assert t.is_alive()  # the third job waits: it does not share a busy GPU
    release(b)
    t.join(5)
    assert out["v"].gpu == b.gpu  # and takes the GPU that freed up
    release(a)
    release(out["v"])


def test_a_worker_keeps_its_gpu_and_a_new_worker_takes_another(tmp_path):
    gpus = ["0", "1"]
    first = reserve(gpus, tmp_path)  # worker A, pinned to GPU 0, between two jobs: no job lock held
    assert first.gpu == "0"
    second = reserve(gpus, tmp_path)  # worker B starts now: GPU 0 is idle but A's, so B gets GPU 1
    assert second.gpu == "1" and reserve(gpus, tmp_path) is None  # a third worker would share
    job = claim(gpus, tmp_path, only="0")
    t, out = in_thread(claim, gpus, tmp_path, "0")  # A's next job waits for GPU 0 even though GPU 1 has no job
    t.join(0.3)
    assert t.is_alive()
    release(job)
    t.join(5)
    assert out["v"].gpu == "0"
    for c in (out["v"], first, second):
        release(c)


def test_a_crashed_worker_frees_its_gpu(tmp_path):
    code = (
        "import os, sys; from pathlib import Path; from experiments.runner.gpu_assign import claim, reserve;"
        f"reserve(['0'], Path({str(tmp_path)!r})); claim(['0'], Path({str(tmp_path)!r}));"
        "print('held', flush=True); os._exit(1)"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "held"
    assert reserve(["0"], tmp_path).gpu == "0" and claim(["0"], tmp_path, only="0").gpu == "0"


def test_the_first_job_of_a_worker_pins_cuda_visible_devices(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_assign, "_PINNED", None)
    monkeypatch.setattr(gpu_assign, "_RESERVATION", None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,7")
    cb = gpu_assign.OneGpuPerJob(lock_dir=str(tmp_path))
    cb.on_multirun_start(config=composed())
    assert cb.gpus == ["4", "7"]
    for _ in range(2):  # two jobs of one worker: the same GPU both times
        cb.on_job_start(config=composed())
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "4" and cb._claim.gpu == "4"
        cb.on_job_end(config=None, job_return=None)
    release(gpu_assign._RESERVATION)


def test_no_gpu_visible_is_one_error_line_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(SystemExit) as e:
        gpu_assign.OneGpuPerJob(lock_dir=str(tmp_path)).on_multirun_start(config=composed())
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: hydra/launcher=gpus: no GPU visible") and err.count("\n") == 1


# ---- one host's GPUs: a real sweep -------------------------------------------------------------------------------
FAST = ["model.weights=synthetic", "workload.prompt=random", "workload.gen_tokens=4", "wandb.enabled=false"]


def sweep(tmp: Path, *overrides: str) -> subprocess.CompletedProcess:
    pytest.importorskip(
        "hydra_plugins.hydra_joblib_launcher", reason="hydra-joblib-launcher is not installed (the `gpus` extra)"
    )
    cmd = [sys.executable, "-m", "experiments.run", "--multirun", "hydra/launcher=gpus"]
    cmd += ["hydra.callbacks.one_gpu_per_job.gpus=[7,9]", f"hydra.callbacks.one_gpu_per_job.lock_dir={tmp / 'locks'}"]
    cmd += [f"results_dir={tmp / 'results'}", f"hydra.sweep.dir={tmp / 'multi'}", *FAST, *overrides]
    env = {**os.environ, "WANDB_SILENT": "true", "HYDRA_FULL_ERROR": "0"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("job_process", ["inline", "fork"])
def test_a_sweep_over_two_gpus_pins_each_worker_and_keeps_records_skips_and_the_table(tmp_path, job_process):
    """fork: each job in a child of its worker, which inherits the worker's GPU."""
    t0 = time.monotonic()
    p = sweep(tmp_path, "seqlen=64,96,9000", f"job_process={job_process}")
    assert p.returncode == 1, p.stderr[-3000:]  # seqlen=9000 does not fit SmolLM2: recorded, the sweep goes on
    jobs = {
        int(n): (gpu, pid)
        for n, gpu, pid in re.findall(r"\[gpus\] job #(\d+) on GPU (\S+) \(worker pid (\d+)\)", p.stderr)
    }
    assert sorted(jobs) == [0, 1, 2], p.stderr[-3000:]
    by_worker = {}
    for gpu, pid in jobs.values():
        by_worker.setdefault(pid, set()).add(gpu)
    assert all(len(g) == 1 for g in by_worker.values()), by_worker  # a worker keeps its GPU
    assert len({next(iter(g)) for g in by_worker.values()}) == len(by_worker)  # and no two workers share one
    recs = {
        r["identity"][1]: r for r in map(json.loads, map(Path.read_text, (tmp_path / "results").glob("*/record.json")))
    }
    assert {k: r["status"] for k, r in recs.items()} == {"seqlen=64": "ok", "seqlen=96": "ok", "seqlen=9000": "failed"}
    assert recs["seqlen=64"]["environment"]["cuda_visible_devices"] == jobs[0][0]  # the pin reached the run
    ran_in_worker = recs["seqlen=64"]["environment"]["pid"] == int(jobs[0][1])
    assert ran_in_worker == (job_process == "inline")
    assert "[sweep] 3 jobs: 2 ok, 0 skipped, 1 failed" in p.stderr  # the workers' outcomes, in the launching process
    again = sweep(tmp_path, "seqlen=64,96")
    assert again.returncode == 0 and "[sweep] 2 jobs: 0 ok, 2 skipped, 0 failed" in again.stderr, again.stderr[-3000:]
    assert time.monotonic() - t0 < 240


@pytest.mark.slow
def test_the_multi_gpu_comparison_runs_one_sweep_both_ways(tmp_path):
    """experiments.bench.multi_gpu_sweep: the same sweep over a pool of GPUs and on its first one,
    each into its own folder, both wall times in one record (on a CPU host the named pool is notional)."""
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="hydra-joblib-launcher is not installed")
    out = tmp_path / "multi_gpu.json"
    cmd = [
        sys.executable,
        "-m",
        "experiments.bench.multi_gpu_sweep",
        "--out",
        str(out),
        "--runs",
        str(tmp_path / "runs"),
    ]
    p = subprocess.run(
        [*cmd, "--gpus", "7,9", "--", "seqlen=64,96", *FAST], cwd=ROOT, capture_output=True, text=True, timeout=400
    )
    assert p.returncode == 0, p.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["gpus"] == ["7", "9"] and rec["speedup"] > 0
    for way in ("every_gpu", "one_gpu"):
        assert rec[way]["exit"] == 0 and rec[way]["wall_s"] > 0
        assert sorted(j["status"] for j in rec[way]["jobs"].values()) == ["ok", "ok"]
    assert "2 jobs:" in p.stdout
    p = subprocess.run([*cmd, "--gpus", "0", "--", "seqlen=64"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.startswith("error: multi_gpu_sweep needs a pool of 2 GPUs")
    p = subprocess.run([*cmd, "--gpus", "7,9", "--", "seqlen=64"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 2 and "is not empty: its records would be skipped, not timed" in p.stderr  # a rerun
    cmd[cmd.index("--runs") + 1] = str(tmp_path / "runs2")
    p = subprocess.run([*cmd, "--gpus", "7,9", "--", "seqlen=abc"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.count("error:") == 1 and "seqlen='abc'" in p.stderr  # refused once
    assert json.loads(out.read_text()) == rec  # and nothing written
