"""The helpers in scripts/: the shell scripts parse, and the host-memory warm-up refuses a size the
machine does not have before touching anything, and touches what it is asked to."""

import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.paths import ROOT


def test_the_shell_scripts_parse():
    for script in ("gpu_session.sh", "interpret_kernels.sh"):
        assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)]).returncode == 0, script


def gpu_session(tmp_path, *stages: str, **env: str) -> subprocess.CompletedProcess:
    """scripts/gpu_session.sh with commit abc1234 and the stages named, its session folders under tmp_path (for
    /tmp) and stand-ins first on PATH: nvidia-smi and python3 do nothing (no wheels installed, no stage's command
    run; python3 writes its arguments to tmp_path/python3.args) but scripts/resume_runs.py, which runs in this
    interpreter."""
    import os

    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    (bin_ / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (bin_ / "python3").write_text(
        f'#!/bin/sh\ncase "$1" in scripts/resume_runs.py) exec "{sys.executable}" "$@";; esac\n'
        f'echo "$@" >> "{tmp_path}/python3.args"\nexit 0\n'
    )
    for f in bin_.iterdir():
        f.chmod(0o755)
    full = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "OUT": str(tmp_path / "out")}
    full |= {"GPU_SESSION_TMP": str(tmp_path), **env}
    cmd = ["bash", "scripts/gpu_session.sh", "abc1234", *stages]
    return subprocess.run(cmd, cwd=ROOT, env=full, capture_output=True, text=True, timeout=60)


def test_gpu_session_cuts_each_stage_to_the_calls_end(tmp_path):
    """A stage's box is cut to what is left of the call (CALL_SECS) less the pack's margin, and a stage with no time
    left is not started: the pack after each stage must run before the device call ends."""
    gpu_session(tmp_path, "skew_eigh", CALL_SECS="30", PACK_SECS="20")
    first = (tmp_path / "out" / "summary.log").read_text().splitlines()[0]  # skew_eigh's own box is 60 s
    assert first.startswith("== skew_eigh (box ") and 5 <= int(first.split("box ")[1].split()[0]) <= 10, first
    assert (tmp_path / "out" / "gpu_session.tgz").exists()
    gpu_session(tmp_path, "skew_eigh", CALL_SECS="21", PACK_SECS="20")
    assert (tmp_path / "out" / "summary.log").read_text().startswith("== skew_eigh: not run, ")


def test_gpu_session_runs_each_of_fig10s_sweeps_in_turn(tmp_path):
    """FIG10 with ";" between override lists runs one sweep per list, into the same runs/; without FIG10, one sweep
    of the whole grid."""
    gpu_session(tmp_path, "fig10", FIG10="hardware.gpu_mem_gb=null seqlen=32k batch=32 ; seqlen=512k")
    sweeps = [a for a in (tmp_path / "python3.args").read_text().splitlines() if "experiments.run" in a]
    assert len(sweeps) == 2 and len({a.split(" +experiment=")[0] for a in sweeps}) == 1, sweeps
    assert sweeps[0].endswith("+experiment=fig10_throughput hardware.gpu_mem_gb=null seqlen=32k batch=32"), sweeps
    assert sweeps[1].endswith("+experiment=fig10_throughput seqlen=512k"), sweeps
    (tmp_path / "python3.args").unlink()
    gpu_session(tmp_path, "fig10", FIG10="seqlen=32k batch=32 ;; seqlen=512k ; ")  # blank lists: no whole grid
    sweeps = [a for a in (tmp_path / "python3.args").read_text().splitlines() if "experiments.run" in a]
    assert [a.split("+experiment=fig10_throughput")[1] for a in sweeps] == [" seqlen=32k batch=32", " seqlen=512k"]
    (tmp_path / "python3.args").unlink()
    gpu_session(tmp_path, "fig10", FIG10=" ; ")
    assert "experiments.run" not in (tmp_path / "python3.args").read_text()  # nothing swept
    assert "no override list" in (tmp_path / "out" / "summary.log").read_text()
    (tmp_path / "python3.args").unlink()
    gpu_session(tmp_path, "fig10")
    sweeps = [a for a in (tmp_path / "python3.args").read_text().splitlines() if "experiments.run" in a]
    assert len(sweeps) == 1 and sweeps[0].endswith("+experiment=fig10_throughput"), sweeps


def test_gpu_session_resumes_the_last_call_of_its_sweep_on_a_warm_machine(tmp_path):
    """RESUME=warm takes the runs/ of the newest earlier session folder of the same SWEEP on this machine, and says
    so when there is none."""
    import json
    import os

    p = gpu_session(tmp_path, "no_such_stage", RESUME="warm")
    assert "nothing resumed" in p.stdout, p.stdout + p.stderr

    def earlier(name: str, age_s: int, sweep: str = "main") -> Path:
        runs = tmp_path / f"gpu_session.{sweep}.{name}" / "runs"
        record = runs / f"seqlen=8k,system={name}-1" / "record.json"
        record.parent.mkdir(parents=True)
        record.write_text(json.dumps({"status": "ok", "environment": {"git": {"commit": "abc1234"}}}))
        os.utime(runs, (runs.stat().st_mtime - age_s,) * 2)
        return runs

    earlier("old1", 100)
    newest = earlier("new1", 10)
    earlier("other", 0, sweep="b")  # newer, of another sweep
    p = gpu_session(tmp_path, "no_such_stage", RESUME="warm")
    assert f"resumed 1 of 1 records (ok or refused, commit abc1234) from {newest}" in p.stdout, p.stdout + p.stderr
    p = gpu_session(tmp_path, "no_such_stage", RESUME="warm", SWEEP="b c")
    assert p.returncode == 2 and "SWEEP=b c: letters" in p.stderr


@pytest.mark.slow
def test_touch_host_memory_refuses_more_than_available_and_touches_what_fits():
    script = str(ROOT / "scripts/touch_host_memory.py")
    p = subprocess.run([sys.executable, script, "--gb", "1e9"], capture_output=True, text=True)
    assert p.returncode == 1 and "must lie in (0," in p.stderr and p.stdout == ""
    p = subprocess.run([sys.executable, script, "--gb", "1"], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.startswith("touched 1 GiB"), p.stderr


def test_resume_takes_the_earlier_calls_ok_records_and_refusals_of_this_commit(tmp_path):
    """scripts/resume_runs.py: a record of this commit that ended ok, or that is a fit refusal, is copied under
    its run's folder name (so the sweep skips that point); one of another commit or of a dirty tree, a crashed
    one, a refusal of another commit and a damaged one are not."""
    import json

    earlier, runs = tmp_path / "earlier", tmp_path / "runs"
    refused = {"status": "failed", "error_kind": "config", "error": "system=clo ... needs about 52.7 GB of GPU memory"}
    crashed = {"status": "failed", "error_kind": "crash", "error": "AssertionError: a KV buffer spans 2^31"}

    def record(name: str, commit: str = "abc1234", text: str | None = None, **fields) -> None:
        (earlier / name).mkdir(parents=True)
        rec = {"status": "ok", **fields, "environment": {"git": {"commit": commit}}}
        (earlier / name / "record.json").write_text(text if text is not None else json.dumps(rec))

    record("seqlen=8k,system=clo-1")
    record("seqlen=8k,system=retroinfer-2", commit="def5678")
    record("seqlen=8k,system=infinigen-3", **crashed)
    record("seqlen=8k,system=fullattn-4", text="{")
    record("seqlen=32k,system=clo-5", **refused)
    record("seqlen=32k,system=retroinfer-6", commit="def5678", **refused)
    (earlier / "dirty").mkdir()
    dirty = {"status": "ok", "environment": {"git": {"commit": "abc1234", "dirty": True}}}
    (earlier / "dirty" / "record.json").write_text(json.dumps(dirty))
    script = str(ROOT / "scripts/resume_runs.py")
    p = subprocess.run([sys.executable, script, str(earlier), str(runs), "abc1234def"], capture_output=True, text=True)
    assert p.returncode == 0 and "resumed 2 of 7 records" in p.stdout, p.stderr
    taken = sorted(q.relative_to(runs).as_posix() for q in runs.rglob("record.json"))
    assert taken == ["seqlen=32k,system=clo-5/record.json", "seqlen=8k,system=clo-1/record.json"]
    p = subprocess.run(
        [sys.executable, script, str(tmp_path / "nowhere"), str(runs), "abc"], capture_output=True, text=True
    )
    assert p.returncode == 2 and p.stderr.startswith("error: RESUME=")


def test_pack_records_names_each_point_and_leaves_failures_out(tmp_path):
    """scripts/pack_records.py: each run's record and each fit refusal is copied as record_<system>_<seqlen>_b<batch>
    .json, byte for byte; a crash or bad input is listed, not packed; two records of one point are refused before
    anything is written."""
    import json

    runs, out = tmp_path / "runs", tmp_path / "packed"

    def record(name: str, **rec) -> None:
        (runs / name).mkdir(parents=True)
        identity = ["+experiment=fig10_throughput", *name.split(",")]
        (runs / name / "record.json").write_text(json.dumps({"identity": identity, **rec}, indent=2))

    record("batch=4,seqlen=8k,system=clo", status="ok")
    record("batch=64,seqlen=128k,system=fullattn", status="failed", error_kind="config", error="... needs about 9 GB")
    record("batch=1,seqlen=1m,system=clo", status="failed", error_kind="config", error="seqlen exceeds\nits positions")
    record("batch=2,seqlen=8k,system=clo", status="failed", error_kind="runtime", error="CUDA error")
    script = str(ROOT / "scripts/pack_records.py")
    p = subprocess.run([sys.executable, script, str(runs), "--out", str(out)], capture_output=True, text=True)
    assert p.returncode == 0 and "packed 2 records" in p.stdout and "not packed: 2 failed" in p.stdout, p.stderr
    assert "seqlen exceeds" in p.stdout and "CUDA error" in p.stdout
    assert sorted(q.name for q in out.iterdir()) == ["record_clo_8k_b4.json", "record_fullattn_128k_b64.json"]
    assert (out / "record_clo_8k_b4.json").read_text() == (
        runs / "batch=4,seqlen=8k,system=clo/record.json"
    ).read_text()
    record("batch=4,seqlen=8k,system=clo,force=true", status="ok")  # the same point again
    p = subprocess.run(
        [sys.executable, script, str(runs), "--out", str(tmp_path / "again")], capture_output=True, text=True
    )
    assert p.returncode == 2 and "are both record_clo_8k_b4.json" in p.stderr and not (tmp_path / "again").exists()


def test_pack_records_adds_to_a_folder_but_replaces_a_record_only_when_asked(tmp_path):
    """The rest of a grid packs beside its first part; the same record packed again is no conflict, another record
    of a point already there is refused (nothing written) unless --replace."""
    import json

    out, script = tmp_path / "packed", str(ROOT / "scripts/pack_records.py")

    def sweep(name: str, *points: tuple[str, str]) -> Path:
        for p, commit in points:
            (tmp_path / name / p).mkdir(parents=True)
            rec = {"status": "ok", "identity": p.split(","), "environment": {"git": {"commit": commit}}}
            (tmp_path / name / p / "record.json").write_text(json.dumps(rec))
        return tmp_path / name

    def pack(runs: Path, *flags: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, script, str(runs), "--out", str(out), *flags], capture_output=True, text=True
        )

    first = sweep("first", ("batch=1,seqlen=8k,system=clo", "aaa1111"))
    assert pack(first).returncode == 0 and pack(first).returncode == 0  # packing the same records twice is fine
    rest = sweep("rest", ("batch=2,seqlen=8k,system=clo", "bbb2222"), ("batch=1,seqlen=8k,system=clo", "bbb2222"))
    p = pack(rest)
    assert p.returncode == 2 and "record_clo_8k_b1.json holds another record" in p.stderr, p.stderr
    assert sorted(q.name for q in out.iterdir()) == ["record_clo_8k_b1.json"]  # nothing written
    assert pack(rest, "--replace").returncode == 0
    commits = {q.name: json.loads(q.read_text())["environment"]["git"]["commit"] for q in out.iterdir()}
    assert commits == {"record_clo_8k_b1.json": "bbb2222", "record_clo_8k_b2.json": "bbb2222"}
    # a fit refusal run again: the same words keep the packed record, other words are another record of the point
    refusal = {"status": "failed", "error_kind": "config", "error": "... needs about 152.1 GB"}
    for name, commit, error in (("again", "ccc3333", refusal["error"]), ("other", "ddd4444", "... needs about 9 GB")):
        p = "batch=2,seqlen=512k,system=fullattn"
        (tmp_path / name / p).mkdir(parents=True)
        rec = {**refusal, "error": error, "identity": p.split(","), "environment": {"git": {"commit": commit}}}
        (tmp_path / name / p / "record.json").write_text(json.dumps(rec))
    (out / "record_fullattn_512k_b2.json").write_text(
        (tmp_path / "again/batch=2,seqlen=512k,system=fullattn/record.json").read_text().replace("ccc3333", "aaa1111")
    )
    p = pack(tmp_path / "again")
    assert p.returncode == 0 and "packed 0 records" in p.stdout and "kept 1 packed refusals" in p.stdout, p.stderr
    assert "aaa1111" in (out / "record_fullattn_512k_b2.json").read_text()
    assert pack(tmp_path / "other").returncode == 2
    (out / "record_fullattn_512k_b2.json").write_text("{")  # a damaged packed record: one error line, nothing written
    p = pack(tmp_path / "again")
    assert p.returncode == 2 and p.stderr.startswith("error: ") and "not a readable JSON record" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
