"""The device-session helpers in scripts/: the shell script parses, and the host-memory warm-up refuses a size the
machine does not have before touching anything, and touches what it is asked to."""

import subprocess
import sys

from kvoffload.paths import ROOT


def test_gpu_session_script_parses():
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts/gpu_session.sh")]).returncode == 0


def test_gpu_session_cuts_each_stage_to_the_calls_end(tmp_path):
    """A stage's box is cut to what is left of the call (CALL_SECS) less the pack's margin, and a stage with no time
    left is not started: the pack after each stage must run before the device call ends."""
    import os

    def session(call_secs: int) -> str:
        env = {**os.environ, "OUT": str(tmp_path), "GPU_SESSION_TMP": str(tmp_path), "CALL_SECS": str(call_secs)}
        env["PACK_SECS"] = "20"
        cmd = ["bash", "scripts/gpu_session.sh", "abc1234", "skew_eigh"]
        subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=120)
        return (tmp_path / "summary.log").read_text()

    first = session(30).splitlines()[0]  # skew_eigh's own box is 60 s
    assert first.startswith("== skew_eigh (box ") and 0 < int(first.split("box ")[1].split()[0]) <= 10, first
    assert (tmp_path / "gpu_session.tgz").exists()
    assert session(21).startswith("== skew_eigh: not run, ")


def test_gpu_session_resumes_the_last_call_on_a_warm_machine(tmp_path):
    """RESUME=warm takes the runs/ of the newest earlier session folder on this machine (GPU_SESSION_TMP stands for
    /tmp), and says so when there is none."""
    import json
    import os

    env = {**os.environ, "OUT": str(tmp_path / "out"), "GPU_SESSION_TMP": str(tmp_path), "RESUME": "warm"}
    cmd = ["bash", "scripts/gpu_session.sh", "abc1234", "no_such_stage"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert "nothing resumed" in p.stdout, p.stdout + p.stderr
    record = tmp_path / "gpu_session.old1" / "runs" / "seqlen=8k,system=clo-1" / "record.json"
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"status": "ok", "environment": {"git": {"commit": "abc1234"}}}))
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert f"resumed 1 of 1 records (ok, commit abc1234) from {record.parents[1]}" in p.stdout, p.stdout + p.stderr


def test_touch_host_memory_refuses_more_than_available_and_touches_what_fits():
    script = str(ROOT / "scripts/touch_host_memory.py")
    p = subprocess.run([sys.executable, script, "--gb", "1e9"], capture_output=True, text=True)
    assert p.returncode == 1 and "must lie in (0," in p.stderr and p.stdout == ""
    p = subprocess.run([sys.executable, script, "--gb", "1"], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.startswith("touched 1 GiB"), p.stderr


def test_resume_takes_the_earlier_calls_ok_records_of_this_commit(tmp_path):
    """scripts/resume_runs.py: a record of this commit that ended ok is copied under its run's folder name (so the
    sweep skips that point); one of another commit or of a dirty tree, a failed one and a damaged one are not."""
    import json

    earlier, runs = tmp_path / "earlier", tmp_path / "runs"

    def record(name: str, status: str = "ok", commit: str = "abc1234", text: str | None = None) -> None:
        (earlier / name).mkdir(parents=True)
        rec = {"status": status, "environment": {"git": {"commit": commit}}}
        (earlier / name / "record.json").write_text(text if text is not None else json.dumps(rec))

    record("seqlen=8k,system=clo-1")
    record("seqlen=8k,system=retroinfer-2", commit="def5678")
    record("seqlen=8k,system=infinigen-3", status="failed")
    record("seqlen=8k,system=fullattn-4", text="{")
    (earlier / "dirty").mkdir()
    dirty = {"status": "ok", "environment": {"git": {"commit": "abc1234", "dirty": True}}}
    (earlier / "dirty" / "record.json").write_text(json.dumps(dirty))
    script = str(ROOT / "scripts/resume_runs.py")
    p = subprocess.run([sys.executable, script, str(earlier), str(runs), "abc1234def"], capture_output=True, text=True)
    assert p.returncode == 0 and "resumed 1 of 5 records" in p.stdout, p.stderr
    assert [q.relative_to(runs).as_posix() for q in runs.rglob("record.json")] == ["seqlen=8k,system=clo-1/record.json"]
    p = subprocess.run(
        [sys.executable, script, str(tmp_path / "nowhere"), str(runs), "abc"], capture_output=True, text=True
    )
    assert p.returncode == 2 and p.stderr.startswith("error: RESUME=")
