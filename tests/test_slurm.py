"""hydra/launcher=slurm for real: a one-node Slurm cluster on this machine (scripts/slurm_local.sh, from Debian's
slurm-wlm and munge; the `slurm` fixture), sweeps submitted through sbatch, and their endings (ok, failed, cancelled
with scancel, past the time limit) read from the records and the sweep's table. Without the packages those tests
skip. The refusal where Slurm is missing, and how the launcher reads a job's end, run everywhere."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

# one cluster for the module: under `pytest -n`, its tests share one worker (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("slurm")
ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "slurm_local.sh"
COMMANDS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scancel")
# the smallest run there is: synthetic SmolLM2 weights, a random prompt, 4 tokens; one core and 2 GB a job, no GPU
FAST = ["model.weights=synthetic", "workload.prompt=random", "workload.gen_tokens=4", "wandb.enabled=false"]
LOCAL = ["hydra.launcher.gpus_per_node=null", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=2"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running one-node cluster for this module's tests, stopped after them: the environment that reaches it."""
    path = f"{os.environ['PATH']}{os.pathsep}/usr/sbin{os.pathsep}/sbin"  # the daemons live in sbin
    missing = [c for c in COMMANDS if shutil.which(c, path=path) is None]
    if missing:
        pytest.skip(
            f"Slurm's Debian packages are not installed (no {', '.join(missing)}): apt-get install slurm-wlm munge"
        )
    state = tmp_path_factory.mktemp("slurm")
    p = subprocess.run(["bash", str(SCRIPT), "start", str(state)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == f"export SLURM_CONF={state / 'slurm.conf'}", p.stderr
    yield {**os.environ, "SLURM_CONF": str(state / "slurm.conf"), "WANDB_SILENT": "true"}
    subprocess.run(["bash", str(SCRIPT), "stop", str(state)], timeout=120)
    for daemon in ("munged", "slurmctld", "slurmd"):  # stop left none of them behind
        assert not (state / f"{daemon}.pid").exists()


def sweep_command(tmp: Path, *overrides: str) -> list[str]:
    cmd = [sys.executable, "-m", "experiments.run", "--multirun", "hydra/launcher=slurm", *LOCAL]
    return cmd + [f"results_dir={tmp / 'results'}", f"hydra.sweep.dir={tmp / 'multi'}", *FAST, *overrides]


def records(tmp: Path) -> dict[str, dict]:
    """The sweep's records by the seqlen (or, for one run, 'run') that tells them apart."""
    recs = [json.loads(p.read_text()) for p in (tmp / "results").glob("*/record.json")]
    return {next((o for o in r["identity"] if o.startswith("seqlen=")), "run"): r for r in recs}


def table(stderr: str) -> dict[str, tuple[str, str]]:
    """The sweep table's rows: {overrides: (status, error)}."""
    rows = re.findall(r"^  #\d+\s+(\w+)\s+(.*?)(?:\s+error: (.*))?$", stderr, re.M)
    return {ov: (status, error) for status, ov, error in rows}


# ---- without Slurm ---------------------------------------------------------------------------------------------
def fake_bin(tmp: Path, **scripts: str) -> str:
    """A PATH of one folder holding the named shell scripts (and nothing else)."""
    (tmp / "bin").mkdir()
    for name, body in scripts.items():
        (tmp / "bin" / name).write_text(f"#!/bin/sh\n{body}\n")
        (tmp / "bin" / name).chmod(0o755)
    return str(tmp / "bin")


def test_without_slurm_the_slurm_launcher_is_one_error_line_and_exit_2(tmp_path):
    env = {**os.environ, "PATH": fake_bin(tmp_path)}  # no sbatch, no srun
    env.pop("SLURM_CONF", None)
    cmd = [sys.executable, "-m", "experiments.run", "--multirun", "hydra/launcher=slurm", "seqlen=64,96"]
    p = subprocess.run(
        [*cmd, f"hydra.sweep.dir={tmp_path / 'multi'}"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    says = "error: hydra/launcher=slurm needs Slurm's sbatch and srun on PATH; sbatch and srun not found"
    assert p.returncode == 2 and p.stderr.startswith(says) and p.stderr.count("\n") == 1, p.stderr
    assert "scripts/slurm_local.sh" in p.stderr and not (tmp_path / "multi").exists()  # refused before any work


def test_slurm_commands_that_reach_no_cluster_are_one_error_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """Debian's packages with no cluster configured: the commands run but reach nothing."""
    from experiments.runner.cli_checks import refuse_unknown_keys

    sinfo = "echo 'sinfo: fatal: Could not establish a configuration source' >&2; exit 1"
    monkeypatch.setenv("PATH", fake_bin(tmp_path, sbatch="exit 0", srun="exit 0", sinfo=sinfo))
    with pytest.raises(SystemExit) as e:
        refuse_unknown_keys(["--multirun", "hydra/launcher=slurm", "seqlen=64,96"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: hydra/launcher=slurm: sbatch and srun are here but reach no Slurm cluster (sinfo: ")
    assert refuse_unknown_keys(["hydra/launcher=slurm", "seqlen=64"]) == []  # no --multirun: no launcher, no check


def test_without_the_slurm_extra_the_plugin_module_imports_quietly():
    """Hydra imports every hydra_plugins module at each start and warns of one that fails to import."""
    code = (
        "import sys, warnings; warnings.simplefilter('error');"
        "sys.modules['hydra_plugins.hydra_submitit_launcher.submitit_launcher'] = None;"
        "import hydra_plugins.clo_slurm_launcher.slurm as m; print(hasattr(m, 'SlurmLauncher'))"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stderr


# ---- how the launcher reads a job's end ----------------------------------------------------------------------------
def test_without_accounting_job_states_come_from_squeue(tmp_path, monkeypatch):
    pytest.importorskip("submitit", reason="submitit is not installed (the `slurm` extra)")
    from experiments.runner.slurm_launcher import GONE, SqueueFallbackWatcher

    squeue = "printf '7_0|COMPLETED|vm\\n7_1|CANCELLED|vm\\n7_[2-3%%2]|PENDING|\\n'"
    sacct = "echo 'Slurm accounting storage is disabled' >&2; exit 1"
    monkeypatch.setenv("PATH", fake_bin(tmp_path, sacct=sacct, squeue=squeue))
    watcher = SqueueFallbackWatcher(delay_s=600)
    for i in range(5):
        watcher.register_job(f"7_{i}")
    watcher.update()
    states = {f"7_{i}": watcher.get_state(f"7_{i}", mode="cache") for i in range(5)}
    assert states == {"7_0": "COMPLETED", "7_1": "CANCELLED", "7_2": "PENDING", "7_3": "PENDING", "7_4": GONE}
    assert [watcher.is_done(j, mode="cache") for j in states] == [True, True, False, False, True]


@pytest.mark.parametrize(
    "state, error, status, says",
    [
        ("CANCELLED by 0", "has not produced any output", "cancelled", "was cancelled (cancelled by 0)"),
        ("TIMEOUT", "has not produced any output", "timeout", "ran past its time limit"),
        (
            "COMPLETED",
            "...\nUncompletedJobError: Job not requeued because: timed-out too many times.",
            "timeout",
            "time",
        ),
        (
            "FAILED",
            "trace:\n----\nRuntimeError: a lost node\n----",
            "failed",
            "(state FAILED): RuntimeError: a lost node",
        ),
    ],
)
def test_a_job_without_a_result_ends_as_slurm_says(state, error, status, says):
    pytest.importorskip("submitit", reason="submitit is not installed (the `slurm` extra)")
    from experiments.runner.slurm_launcher import ending

    class Watcher:
        def get_state(self, job_id, mode):
            return state

    class Job:
        job_id, watcher = "7_1", Watcher()

    got, message = ending(Job(), RuntimeError(error))
    assert got == status and says in message and "7_1" in message


def test_the_sweep_table_counts_cancelled_and_timed_out_jobs():
    from experiments.runner.records import SweepSummary

    summary = SweepSummary()
    summary.jobs = [
        (0, ["seqlen=64"], "ok", ""),
        (1, ["seqlen=96"], "cancelled", "Slurm job 5_1 was cancelled"),
        (2, ["seqlen=128"], "timeout", "Slurm job 5_2 ran past its time limit"),
    ]
    text = summary.table()
    assert text.splitlines()[0] == "[sweep] 3 jobs: 1 ok, 0 skipped, 0 failed, 1 cancelled, 1 timeout"
    assert table(text) == {
        "seqlen=64": ("ok", ""),
        "seqlen=96": ("cancelled", "Slurm job 5_1 was cancelled"),
        "seqlen=128": ("timeout", "Slurm job 5_2 ran past its time limit"),
    }
    with pytest.raises(SystemExit) as e:  # neither is a success: the sweep's exit status says so
        summary.on_multirun_end(config=None)
    assert e.value.code == 1


# ---- through sbatch --------------------------------------------------------------------------------------------
def wait_for(what, timeout_s: float, poll_s: float = 0.5):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if found := what():
            return found
        time.sleep(poll_s)
    raise AssertionError(f"gave up after {timeout_s} s waiting for {what.__doc__}")


@pytest.mark.slow
def test_a_slurm_sweep_records_every_run_fails_a_row_and_resumes_a_cancelled_job(slurm, tmp_path):
    """seqlen=9000 does not fit SmolLM2 (a failed row); the seqlen=3000 job is cancelled with scancel once it runs
    (its prefill takes seconds on a CPU: a short job could end before scancel lands); the same command again skips
    the finished run and runs the cancelled one."""
    cmd = sweep_command(tmp_path, "seqlen=64,3000,9000")
    sweep = subprocess.Popen(cmd, cwd=ROOT, env=slurm, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def job_1_running():
        """job #1 to start its run"""
        folders = list((tmp_path / "multi" / ".submitit").glob("*_1"))
        return (tmp_path / "multi" / "1").is_dir() and folders and folders[0].name

    job = wait_for(job_1_running, 180)
    subprocess.run(["scancel", job], env=slurm, check=True)
    _, err = sweep.communicate(timeout=400)
    assert sweep.returncode == 1 and "Traceback" not in err, err[-3000:]
    assert "[sweep] 3 jobs: 1 ok, 0 skipped, 1 failed, 1 cancelled" in err, err[-3000:]
    rows = table(err)
    assert rows["seqlen=64"] == ("ok", "") and rows["seqlen=3000"][0] == "cancelled" and job in rows["seqlen=3000"][1]
    assert rows["seqlen=9000"][0] == "failed" and "max_position_embeddings" in rows["seqlen=9000"][1]
    recs = records(tmp_path)
    assert sorted(recs) == ["seqlen=64", "seqlen=9000"]  # the cancelled run wrote none
    assert recs["seqlen=64"]["status"] == "ok" and recs["seqlen=64"]["metrics"]["decode_tokens_per_s"] > 0
    assert recs["seqlen=9000"]["status"] == "failed" and recs["seqlen=9000"]["error_kind"] == "config"
    first = recs["seqlen=64"]["environment"]["pid"]

    again = subprocess.run(cmd, cwd=ROOT, env=slurm, capture_output=True, text=True, timeout=400)
    assert again.returncode == 1 and "[sweep] 3 jobs: 1 ok, 1 skipped, 1 failed" in again.stderr, again.stderr[-3000:]
    assert {k: v[0] for k, v in table(again.stderr).items()} == {
        "seqlen=64": "skipped",
        "seqlen=3000": "ok",
        "seqlen=9000": "failed",
    }
    recs = records(tmp_path)
    assert recs["seqlen=3000"]["status"] == "ok" and recs["seqlen=64"]["environment"]["pid"] == first  # not rerun
    assert recs["seqlen=3000"]["environment"]["device"] == "cpu"


@pytest.mark.slow
@pytest.mark.parametrize("signal_delay_s", [30, 0], ids=["signalled", "killed"])
def test_a_slurm_job_past_its_time_limit_is_reported_as_timed_out(slurm, tmp_path, signal_delay_s):
    """A run of 2000 decode steps (minutes on a CPU) with a limit of minutes. signalled: Slurm signals the job
    signal_delay_s before its limit, submitit stops the run there and the run records the timeout (a rerun runs it
    again). killed: no signal; Slurm kills the job at its limit, it leaves no record, and its row is Slurm's state.
    Slurm may signal up to 60 s early (sbatch(1), --signal): a 2-minute limit keeps the signal 30 s or more after
    the start, when the run has begun (a signal before submitit's handler would kill the job: a failed row)."""
    limit = 2 if signal_delay_s else 1
    over = ["workload.gen_tokens=2000", f"hydra.launcher.timeout_min={limit}"]
    over.append(f"hydra.launcher.signal_delay_s={signal_delay_s}")
    t0 = time.monotonic()
    p = subprocess.run(sweep_command(tmp_path, "seqlen=64", *over), cwd=ROOT, env=slurm, capture_output=True, text=True)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "[sweep] 1 job: 0 ok, 0 skipped, 0 failed, 1 timeout" in p.stderr, p.stderr[-3000:]
    ((status, error),) = table(p.stderr).values()
    assert status == "timeout" and "time limit" in error
    if signal_delay_s:
        rec = records(tmp_path)["seqlen=64"]
        assert rec["status"] == "failed" and rec["error_kind"] == "timeout" and "timeout_min" in rec["error"]
        assert time.monotonic() - t0 < 200  # stopped near its limit, not after its 2000 steps
    else:
        assert records(tmp_path) == {} and "ran past its time limit" in error
        assert time.monotonic() - t0 < 300  # Slurm checks limits every 30 s, submitit its states at 64 s, 128 s
