"""Ctrl-C during a run or a sweep: one line, or the sweep's table of what ended and what it stopped, and exit status
130 instead of a 60-line KeyboardInterrupt traceback; no record of the stopped run (records are written whole)."""

import os
import signal
import subprocess
import sys

import pytest
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from experiments.runner.records import SweepSummary
from tests.run_helpers import FAST, ROOT, records

LONG = "workload.gen_tokens=5000"  # a decode that Ctrl-C stops long before its end


def interrupt(tmp, *args: str, at_start: int = 1, group: bool = False) -> subprocess.CompletedProcess:
    """The run command, sent SIGINT once its `at_start`-th run has begun (its "[run] system=..." line) after it
    has loaded the run's modules; group: to its whole process group, as a terminal's Ctrl-C is (a forked job too)."""
    flags = [a for a in args if a.startswith("--")]
    overrides = [a for a in args if not a.startswith("--")]
    where = [f"results_dir={tmp / 'results'}", f"hydra.run.dir={tmp / 'out'}", f"hydra.sweep.dir={tmp / 'multi'}"]
    argv = [sys.executable, "-m", "experiments.run", *flags, *where, *overrides]
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    # SIGINT as a terminal leaves it: a command started in the background of a non-interactive shell (CI under
    # nohup ... &) inherits it ignored, and Python then installs no KeyboardInterrupt handler at all
    default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    p = subprocess.Popen(
        argv, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True, start_new_session=group, preexec_fn=default_sigint
    )
    seen = ""
    for line in p.stderr:
        seen += line
        if seen.count("[run] system=") >= at_start:
            break
    (os.killpg if group else os.kill)(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=300)
    return subprocess.CompletedProcess(argv, p.returncode, "", seen + err)


@pytest.mark.slow
def test_a_run_stopped_by_ctrl_c_is_one_line_and_status_130(tmp_path):
    p = interrupt(tmp_path, "seqlen=64", *FAST, LONG)
    assert p.returncode == 130, p.stderr[-3000:]
    assert p.stderr.rstrip().endswith("\ninterrupted (Ctrl-C): the run stopped before its end")
    assert "Traceback" not in p.stderr and "KeyboardInterrupt" not in p.stderr
    assert records(tmp_path) == {}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["inline", "fork"])
def test_a_sweep_stopped_by_ctrl_c_ends_with_its_table_and_status_130(tmp_path, mode):
    """The first job ends, Ctrl-C stops the second, the third never starts; the same command would resume."""
    args = ("--multirun", "seqlen=64", *FAST[:-1], f"job_process={mode}", "workload.gen_tokens=2,5000,3")
    p = interrupt(tmp_path, *args, at_start=2, group=mode == "fork")
    assert p.returncode == 130, p.stderr[-3000:]
    tail = p.stderr.rstrip().splitlines()[-4:]
    assert tail[0].startswith("[sweep] 2 jobs: 1 ok, 0 skipped, 0 failed, 1 interrupted (all with ")
    assert tail[1].split() == ["#0", "ok", "workload.gen_tokens=2"]
    assert tail[2].split() == ["#1", "interrupted", "workload.gen_tokens=5000"]
    assert tail[3].startswith("[sweep] stopped by Ctrl-C: no later job ran")
    assert "Traceback" not in p.stderr and "KeyboardInterrupt" not in p.stderr
    (rec,) = records(tmp_path).values()
    assert rec["status"] == "ok" and rec["config"]["workload"]["gen_tokens"] == 2


def test_an_interrupted_sweeps_table_names_the_job_it_stopped():
    """As Hydra's basic launcher drives the callback: job 0 ended, job 1 started and never ended."""
    cb = SweepSummary()
    cb.on_multirun_start(config=None)
    assert SweepSummary.running is cb

    def job(i: int):
        return OmegaConf.create({"hydra": {"job": {"num": i}, "overrides": {"task": [f"seqlen={i}", "batch=1"]}}})

    cb.on_job_start(config=job(0))
    ret = JobReturn(overrides=["seqlen=0", "batch=1"], status=JobStatus.COMPLETED)
    ret._return_value = {"status": "ok"}
    cb.on_job_end(config=job(0), job_return=ret)
    cb.on_job_start(config=job(1))
    lines = cb.interrupted_table().splitlines()
    assert lines[0] == "[sweep] 2 jobs: 1 ok, 0 skipped, 0 failed, 1 interrupted (all with batch=1)"
    assert [x.split() for x in lines[1:3]] == [["#0", "ok", "seqlen=0"], ["#1", "interrupted", "seqlen=1"]]
    assert lines[3].startswith("[sweep] stopped by Ctrl-C") and SweepSummary.running is None
    between = SweepSummary()  # stopped before any job started: the line alone
    between.on_multirun_start(config=None)
    assert between.interrupted_table().startswith("[sweep] stopped by Ctrl-C")
