"""Where a sweep's job runs (job_process): inline in the sweep's process (experiments.run), or in a process of its
own, `fork` (a child forked from the sweep's process) or `fresh` (a new interpreter), which then writes the record
and whose outcome the sweep reads back from it."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

from kvoffload.paths import write_json_atomic


def hydra_flags(hc) -> list[str]:
    """The sweep's own config flags, which a job's fresh process must be given again: its --config-name and each
    --config-dir (a search path the command line added)."""
    flags = ["--config-name", hc.job.config_name]
    for source in hc.runtime.config_sources:
        if source.provider == "command-line" and source.schema == "file":
            flags += ["--config-dir", source.path]
    return flags


def run_in_fresh_process(
    flags: list[str], overrides: list[str], path: Path, output_dir: str, env: dict[str, str] | None = None
) -> dict:
    """job_process=fresh: the job as a single run of this command in a new Python process (environment `env`, or
    this one's), so that it inherits no thread pool (numba's, OpenMP's, a fetch worker's), allocator reserve or
    compiled state from the jobs before it."""
    argv = [sys.executable, "-m", "experiments.run", *flags, *overrides, f"hydra.run.dir={output_dir}"]
    before = record_stamp(path)
    code = subprocess.run(argv, check=False, env=env).returncode
    return child_outcome(code, "fresh process", overrides, path, before)


def run_in_forked_child(job: Callable[[], dict], overrides: list[str], path: Path) -> dict:
    """job_process=fork: the job in a child forked from this sweep process, which imports the run's modules once,
    before the first fork, and never runs a job or touches CUDA itself: each child starts as a fresh process would
    (no thread pool, allocator reserve or compiled state of an earlier job, CUDA not yet initialised) without a
    new interpreter's imports and Hydra composition (seconds a job). POSIX only."""
    import experiments.runner.execute  # noqa: F401 - into this process once: every child starts with it imported

    before = record_stamp(path)
    # the child's temporary files, removed once it ends: os._exit runs no atexit cleanup (W&B's temp folders)
    job_tmp = tempfile.mkdtemp(prefix="job-")
    sys.stdout.flush()
    sys.stderr.flush()
    with warnings.catch_warnings():
        if threading.active_count() == 1:
            # no Python thread but this one: the others are native pools that re-form in the child (OpenBLAS's
            # fork handlers); a Python thread (a worker left running) keeps Python's multi-threaded-fork warning
            warnings.simplefilter("ignore", DeprecationWarning)
        parent = os.getpid()
        pid = os.fork()
    if pid == 0:
        code = 1
        die_with_parent(parent)
        os.environ["TMPDIR"] = tempfile.tempdir = job_tmp
        try:
            code = 0 if job()["status"] == "ok" else 1
        except KeyboardInterrupt:  # Ctrl-C reaches the sweep too, whose table says the job was interrupted
            code = 130
        except BaseException:  # noqa: BLE001 - the child must reach os._exit, never the sweep's own code
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            ctypes.CDLL(None).fflush(None)  # what native code printed: os._exit flushes no C stream
            os._exit(code)
    try:
        _, status = os.waitpid(pid, 0)
    except BaseException:  # the sweep interrupted alone: its job must not outlive it, holding the GPU
        stop_child(pid)
        raise
    finally:
        shutil.rmtree(job_tmp, ignore_errors=True)
    return child_outcome(os.waitstatus_to_exitcode(status), "forked child", overrides, path, before)


def die_with_parent(parent: int) -> None:
    """In a forked job: SIGTERM when the sweep's process dies however it dies (killed by pid, SIGKILL), so that no
    job goes on holding the GPU after its sweep (Linux's PR_SET_PDEATHSIG; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the call took effect
        os._exit(1)


def stop_child(pid: int, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it has not ended within grace_s; reaped either way."""
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG)[0]:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def record_stamp(path: Path) -> tuple[int, int] | None:
    """The record file's identity (inode, mtime): an atomic write replaces it, so a child that wrote one changed it."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def child_outcome(code: int, kind: str, overrides: list[str], path: Path, before: tuple[int, int] | None) -> dict:
    """The sweep's outcome of a job its child process ran. The child writes the record (a failed one too), and
    what it wrote is the outcome; a child that wrote none (killed by a signal or the OOM killer; the file, if any,
    still the one from before it ran, `before`) gets a failed record here."""
    rec = None
    if record_stamp(path) != before:
        try:
            rec = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            rec = None
    if rec is None:
        message = f"the job's {kind} exited with status {code} and wrote no record"
        write_json_atomic(path, {"status": "failed", "error_kind": "crash", "error": message, "overrides": overrides})
        print(f"[run] FAILED (crash): {message}; the sweep continues", file=sys.stderr)
        return {"status": "failed", "error": message, "record": str(path)}
    if rec.get("status") == "ok" and code != 0:
        print(f"[run] the job's {kind} exited with status {code} after writing its record", file=sys.stderr)
    # a failed record's own FAILED line was printed by the child that wrote it
    return {"status": rec.get("status"), "error": rec.get("error"), "record": str(path)}
