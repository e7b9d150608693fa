"""Sweeps of the run command (--multirun): a sweep that survives a failing run and resumes, skipping what
finished (fit refusals at this commit too), its end-of-sweep table and exit status, and the job processes of its
own (fresh or forked) that keep records, die with their sweep and leave nothing behind."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.run_helpers import FAST, ROOT, records, run


def sweep_table(stderr: str) -> dict[str, tuple[str, str]]:
    """The end-of-sweep table: {the job's overrides: (status, error)}."""
    lines = stderr[stderr.index("[sweep]") :].splitlines()[1:]
    rows = {}
    for line in lines:
        left, _, error = line.partition("  error: ")
        _num, status, overrides = left.split(maxsplit=2)
        rows[overrides.strip()] = (status, error)
    return rows


def ok_commit(recs: dict) -> str:
    (commit,) = {r["environment"]["git"]["commit"] for r in recs.values() if r["status"] == "ok"}
    return commit


@pytest.mark.slow
def test_sweep_survives_a_failing_run_and_resumes(tmp_path):
    p = run("--multirun", "seqlen=64,96,9000", *FAST, tmp=tmp_path, check=False)
    assert p.returncode == 1, p.stderr[-3000:]  # a job failed: the sweep ran on, then says so
    recs = records(tmp_path)
    status = {name.split("-")[0]: r["status"] for name, r in recs.items()}
    assert sorted(status.values()) == ["failed", "ok", "ok"], status
    failed = next(r for r in recs.values() if r["status"] == "failed")
    assert "max_position_embeddings" in failed["error"] and failed["error_kind"] == "config"
    assert failed["environment"]["git"]["commit"] == ok_commit(recs)  # a failure names its commit as a run does
    assert "the sweep continues" in p.stderr
    assert "[sweep] 3 jobs: 2 ok, 0 skipped, 1 failed" in p.stderr
    table = sweep_table(p.stderr)
    assert table["seqlen=64"] == ("ok", "") and table["seqlen=96"] == ("ok", "")
    assert table["seqlen=9000"][0] == "failed" and "max_position_embeddings=8192" in table["seqlen=9000"][1]
    again = run("--multirun", "seqlen=64,96,9000", *FAST, tmp=tmp_path, check=False)
    assert again.returncode == 1
    assert again.stderr.count("skip:") == 2  # finished runs are skipped, the failed one is retried
    assert "[sweep] 3 jobs: 0 ok, 2 skipped, 1 failed" in again.stderr


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fresh", "fork"])
def test_job_processes_of_their_own_keep_records_failures_skips_and_the_table(tmp_path, mode):
    args = ("--multirun", "seqlen=64,96,9000", f"job_process={mode}", *FAST)
    p = run(*args, tmp=tmp_path, check=False)
    assert p.returncode == 1, p.stderr[-3000:]
    recs = {next(i for i in r["identity"] if i.startswith("seqlen=")): r for r in records(tmp_path).values()}
    assert {k: r["status"] for k, r in recs.items()} == {"seqlen=64": "ok", "seqlen=96": "ok", "seqlen=9000": "failed"}
    pids = {recs[k]["environment"]["pid"] for k in ("seqlen=64", "seqlen=96")}
    assert len(pids) == 2  # each job ran in a process of its own
    stages = recs["seqlen=64"]["stages"]
    assert list(stages) == ["startup", "device", "measure", "weights", "allocate", "fill", "first_step", "decode"]
    assert all(v["s"] >= 0 for v in stages.values())
    if mode == "fresh":
        assert stages["startup"]["s"] > 0.5  # a new interpreter's imports take a while (a fork's are done)
    assert "max_position_embeddings" in recs["seqlen=9000"]["error"]
    assert "[sweep] 3 jobs: 2 ok, 0 skipped, 1 failed" in p.stderr
    again = run(*args, tmp=tmp_path, check=False)
    assert "[sweep] 3 jobs: 0 ok, 2 skipped, 1 failed" in again.stderr


@pytest.mark.slow
def test_a_sweep_whose_every_job_fails_exits_1_with_the_table(tmp_path):
    p = run("--multirun", "seqlen=9000,10000", "system=clo", "system.eta=1.5", *FAST, tmp=tmp_path, check=False)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "[sweep] 2 jobs: 0 ok, 0 skipped, 2 failed (all with " in p.stderr
    table = sweep_table(p.stderr)
    assert set(table) == {"seqlen=9000", "seqlen=10000"}
    assert all(s == "failed" and e for s, e in table.values())
    assert "Traceback" not in p.stderr


@pytest.mark.slow
def test_a_sweep_that_only_succeeds_or_skips_exits_0(tmp_path):
    p = run("--multirun", "seqlen=64", *FAST, tmp=tmp_path)
    assert "[sweep] 1 job: 1 ok, 0 skipped, 0 failed" in p.stderr
    again = run("--multirun", "seqlen=64", *FAST, tmp=tmp_path)
    assert "[sweep] 1 job: 0 ok, 1 skipped, 0 failed" in again.stderr


def test_a_refusal_at_this_commit_is_finished_a_crash_is_not(tmp_path, monkeypatch):
    """A sweep skips a point whose record ended ok or is the preflight's fit refusal at this commit (so a resumed
    device call does not check every refusal again); a refusal of another commit or a dirty tree, a crash and a
    damaged record run again."""
    import json

    from experiments.runner.records import finished

    monkeypatch.setenv("CLO_GIT_COMMIT", "abc1234")
    refusal = {"status": "failed", "error_kind": "config", "error": "system=clo ... needs about 52.7 GB of GPU memory"}

    def record(name: str, rec: dict | None, commit: str = "abc1234", dirty: bool | None = None, text: str = ""):
        path = tmp_path / name / "record.json"
        path.parent.mkdir()
        git = {"commit": commit, "dirty": dirty}
        path.write_text(text or json.dumps({**(rec or {}), "environment": {"git": git}}))
        return path

    assert finished(record("ok", {"status": "ok"}))
    assert finished(record("refused", refusal))
    assert not finished(record("refused_elsewhere", refusal, commit="def5678"))
    assert not finished(record("refused_dirty", refusal, dirty=True))
    assert not finished(record("crashed", {"status": "failed", "error_kind": "crash", "error": "AssertionError"}))
    assert not finished(record("damaged", None, text="{"))
    assert not finished(tmp_path / "never" / "record.json")


@pytest.mark.slow
def test_a_sweep_run_again_skips_its_fit_refusals(tmp_path, monkeypatch):
    """A point refused for the host's RAM is recorded with its commit, and the same sweep run again at that commit
    skips it as it skips a finished run."""
    monkeypatch.setenv("CLO_GIT_COMMIT", "abc1234")  # what the device launcher sets; run() passes os.environ on
    args = ("--multirun", "system=clo", "seqlen=4k", "batch=8192", *FAST)  # thousands of GB: refused on any host
    p = run(*args, tmp=tmp_path, check=False)
    assert p.returncode == 1 and "needs about" in p.stderr and "GB of RAM on this host" in p.stderr, p.stderr[-2000:]
    (rec,) = records(tmp_path).values()
    assert rec["error_kind"] == "config" and rec["environment"]["git"]["commit"] == "abc1234"
    assert rec["environment"]["torch"] and rec["environment"]["device"] == "cpu"  # the environment, as a run's
    again = run(*args, tmp=tmp_path, check=False)
    assert again.returncode == 0 and "[sweep] 1 job: 0 ok, 1 skipped, 0 failed" in again.stderr, again.stderr[-2000:]


def test_sweep_summary_table_counts_every_outcome():
    """records.SweepSummary as Hydra's basic launcher drives it, with a job that raised (a crash outside task)."""
    from types import SimpleNamespace

    from hydra.core.utils import JobReturn, JobStatus
    from omegaconf import OmegaConf

    from experiments.runner.records import SweepSummary

    cb = SweepSummary()
    cb.on_multirun_start(config=None)
    outcomes = [
        ({"status": "ok"}, JobStatus.COMPLETED),
        ({"status": "skipped"}, JobStatus.COMPLETED),
        ({"status": "failed", "error": "seqlen=9000 exceeds it"}, JobStatus.COMPLETED),
        (RuntimeError("boom\nsecond line"), JobStatus.FAILED),
        (None, JobStatus.COMPLETED),
    ]
    for i, (value, status) in enumerate(outcomes):
        ret = JobReturn(overrides=[f"seqlen={i}", "model=smollm2", "results_dir=/tmp/r"], status=status)
        ret._return_value = value
        cb.on_job_end(config=OmegaConf.create({"hydra": {"job": {"num": i}}}), job_return=ret)
    table = cb.table()
    assert table.splitlines()[0] == "[sweep] 5 jobs: 2 ok, 1 skipped, 2 failed (all with model=smollm2)"
    assert "#2  failed   seqlen=2  error: seqlen=9000 exceeds it" in table
    assert "#3  failed   seqlen=3  error: RuntimeError: boom; second line" in table
    assert len(table.splitlines()) == 6 and "results_dir" not in table
    with pytest.raises(SystemExit) as e:
        cb.on_multirun_end(config=None)
    assert e.value.code == 1
    cb.on_job_end(
        config=OmegaConf.create({"hydra": {"job": {"num": 0}}}),
        job_return=SimpleNamespace(
            overrides=["seqlen=1"], status=JobStatus.COMPLETED, _return_value={"status": "skipped"}
        ),
    )
    cb.on_multirun_end(config=None)  # nothing failed: no exit


@pytest.mark.slow
def test_fresh_job_processes_see_the_sweeps_config_dir(tmp_path):
    """A --config-dir (a user's own bundles) reaches each job's fresh process: its experiment composes there too."""
    conf = tmp_path / "myconf" / "experiment"
    conf.mkdir(parents=True)
    (conf / "mine.yaml").write_text("# @package _global_\nseqlen: 80\n")
    p = run("--multirun", f"--config-dir={conf.parent}", "+experiment=mine", "job_process=fresh", *FAST, tmp=tmp_path)
    (rec,) = records(tmp_path).values()
    assert rec["status"] == "ok" and rec["config"]["seqlen"] == 80, p.stderr[-3000:]


def test_a_forked_job_killed_without_a_record_gets_a_failed_one(tmp_path):
    """A child that dies by a signal (the OOM killer's) leaves no record: the sweep writes a failed one and goes on,
    also where a failed record of an earlier sweep lay (its old error is not this run's)."""
    from experiments.runner.job_process import run_in_forked_child

    path = tmp_path / "run" / "record.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"status": "failed", "error": "an earlier sweep's error"}))
    outcome = run_in_forked_child(lambda: os.kill(os.getpid(), signal.SIGKILL), ["seqlen=64"], path)
    rec = json.loads(path.read_text())
    assert outcome["status"] == "failed" and rec["status"] == "failed" and rec["error_kind"] == "crash"
    assert "status -9" in rec["error"] and rec["overrides"] == ["seqlen=64"]


def test_a_forked_jobs_record_is_its_outcome_whatever_its_exit_status(tmp_path):
    """A child that wrote its ok record and then failed (in its W&B log, say) ran: its record stands, as inline."""
    from experiments.runner.job_process import run_in_forked_child
    from kvoffload.paths import write_json_atomic

    path = tmp_path / "record.json"

    def job():
        write_json_atomic(path, {"status": "ok"})
        raise RuntimeError("after the record")

    assert run_in_forked_child(job, ["seqlen=64"], path)["status"] == "ok"
    assert json.loads(path.read_text()) == {"status": "ok"}


def test_stop_child_ends_and_reaps_a_job_that_outlives_its_sweep():
    from experiments.runner.job_process import stop_child

    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a job deaf to SIGTERM: SIGKILL after the grace period
        os.write(ready_w, b"x")
        time.sleep(60)
        os._exit(0)
    os.read(ready_r, 1)
    start = time.monotonic()
    stop_child(pid, grace_s=0.5)
    assert 0.5 <= time.monotonic() - start < 10  # the grace period, then SIGKILL
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, 0)  # reaped


@pytest.mark.slow
def test_a_forked_job_ends_when_its_sweep_is_killed(tmp_path):
    """A sweep process killed by pid (SIGKILL: no handler runs) takes its forked job with it."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    child_pid = tmp_path / "child.pid"
    code = (
        "import os, time, pathlib; from experiments.runner.job_process import run_in_forked_child\n"
        f"def job():\n    pathlib.Path({str(child_pid)!r}).write_text(str(os.getpid())); time.sleep(120)\n"
        f"run_in_forked_child(job, [], pathlib.Path({str(tmp_path / 'record.json')!r}))\n"
    )
    sweep = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    deadline = time.monotonic() + 60
    while not child_pid.exists() or not child_pid.read_text():
        assert time.monotonic() < deadline and sweep.poll() is None
        time.sleep(0.1)
    job = int(child_pid.read_text())
    sweep.kill()
    sweep.wait()
    deadline = time.monotonic() + 10
    try:
        while Path(f"/proc/{job}").exists() and Path(f"/proc/{job}/stat").read_text().split(")")[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the job outlived its sweep"
            time.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(job, signal.SIGKILL)


def test_a_forked_job_leaves_no_temporary_files(tmp_path, monkeypatch):
    """os._exit skips atexit cleanup (W&B removes its temp folders there): a job's temp folder goes when it ends."""
    import tempfile

    from experiments.runner.job_process import run_in_forked_child
    from kvoffload.paths import write_json_atomic

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = tmp_path / "record.json"

    def job():
        Path(tempfile.mkdtemp(), "left.txt").write_text("x")
        write_json_atomic(path, {"status": "ok"})
        return {"status": "ok"}

    assert run_in_forked_child(job, ["seqlen=64"], path)["status"] == "ok"
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]


@pytest.mark.skipif(sys.version_info < (3, 12), reason="Python warns of a multi-threaded fork from 3.12")
def test_a_fork_beside_a_python_thread_keeps_pythons_warning(tmp_path):
    """Only native pools' threads are forgiven at the fork: a Python thread still running may hold a lock the
    child needs, and Python's multi-threaded-fork warning says so."""
    import threading

    from experiments.runner.job_process import run_in_forked_child
    from kvoffload.paths import write_json_atomic

    path = tmp_path / "record.json"
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)
    worker.start()
    try:
        with pytest.warns(DeprecationWarning, match="fork"):
            run_in_forked_child(lambda: write_json_atomic(path, {"status": "ok"}) or {"status": "ok"}, [], path)
    finally:
        stop.set()
        worker.join()
