"""Run records: one folder per run under results_dir, named after the run's overrides as resolved values (so a
sweep that is run again finds its finished runs, however a value was spelled), holding record.json written
atomically; and the end-of-sweep summary (a Hydra callback)."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, NoReturn

import torch
from hydra.experimental.callback import Callback

from kvoffload.errors import ConfigError
from kvoffload.paths import ROOT, write_json_atomic
from plots.records import RecordError, commit_of, read_json, result_record

# Overrides that change where or how a run is reported, not what it measures.
NOT_IDENTITY = ("results_dir", "force", "job_process", "wandb", "hydra")


def config_error(e: BaseException | None) -> ConfigError | None:
    """The ConfigError behind an exception: itself, or the one it was raised from (hydra.utils.instantiate wraps a
    constructor's ConfigError in an InstantiationException whose __cause__ it is)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, ConfigError):
            return e
        seen.add(id(e))
        e = e.__cause__
    return None


def slurm_timed_out(e: object) -> bool:
    """Whether an exception is submitit's word, in a Slurm job's process, that the job reached its time limit (Slurm
    signals it hydra.launcher.signal_delay_s before the limit; submitit raises this wherever the job then is)."""
    return type(e).__name__ == "UncompletedJobError" and "not requeued because: timed-out" in str(e)


def one_line(message: object) -> str:
    return "; ".join(line.strip() for line in str(message).splitlines() if line.strip())


def _value_text(key: str, value: Any) -> str:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if key == "seqlen":
        from experiments.runner.preflight import tokens_text
        from experiments.runner.run_settings import parse_tokens

        try:
            return tokens_text(parse_tokens(value))
        except ConfigError:
            return str(value)  # refused by the run itself; its record lands under the spelling given
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=True)
    if value is None or isinstance(value, (bool, list, dict)):
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)


def run_identity(cfg, overrides: list[str], choices: dict[str, Any]) -> list[str]:
    """The overrides that define a run, each as key=<its resolved value> (seqlen=4096 and seqlen=4k both read
    seqlen=4k, system.eta=0.80 reads system.eta=0.8, a config group its choice), sorted, without the keys that only
    change where or how a run is reported (NOT_IDENTITY)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    parser = OverridesParser.create()
    ident = []
    for text in overrides:
        try:
            o = parser.parse_override(text)
        except HydraException:
            ident.append(text)
            continue
        key = o.key_or_group
        if re.split(r"[./]", key)[0] in NOT_IDENTITY:
            continue
        if o.is_delete():
            ident.append(f"~{key}")
        elif key in choices and o.package is None:  # a config group: its choice
            ident.append(f"{'+' if o.is_add() else ''}{key}={choices[key]}")
        else:
            try:
                value = OmegaConf.select(cfg, key, default=text)
            except Exception:  # noqa: BLE001 - an interpolation that does not resolve: the run reports it
                value = text
            ident.append(f"{key}={_value_text(key, value)}" if value is not text else text)
    return sorted(ident)


def run_name(identity: list[str]) -> str:
    """A readable, filesystem-safe name plus a hash of the run's identity (run_identity)."""
    ident = sorted(identity)
    digest = hashlib.sha1("\n".join(ident).encode()).hexdigest()[:8]
    readable = ",".join(ident) or "defaults"
    safe = "".join(c if c.isalnum() or c in "=,.-_" else "_" for c in readable)[:120]
    return f"{safe}-{digest}"


def record_path(results_dir: Path, identity: list[str]) -> Path:
    return results_dir / run_name(identity) / "record.json"


def finished(path: Path) -> bool:
    """Whether a run's record says it needs no rerun: it ended ok, or it is the preflight's refusal of a point that
    does not fit, recorded at this commit by a clean tree (its estimate changes only with the code; force=true
    checks it again). A crash, bad input and a damaged record run again."""
    try:
        rec = read_json(path)
    except RecordError:  # missing or damaged
        return False
    if not result_record(rec):
        return False
    if rec.get("status") == "ok":
        return True
    commit = commit_of(rec)
    if commit in (None, "unknown") or commit.endswith("(dirty)"):
        return False
    return commit == commit_of({"environment": {"git": git_commit(ROOT)}})


def git_commit(repo: Path) -> dict[str, Any]:
    def git(*args: str) -> str:
        p = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10)
        return p.stdout.strip() if p.returncode == 0 else ""

    try:
        commit = git("rev-parse", "--verify", "HEAD")
        changed = code_files(git("diff", "--name-only", "HEAD").splitlines())
    except (OSError, subprocess.SubprocessError):
        commit, changed = "", None
    # The launcher's word wins: the GPU machine's copy of the tree may carry a stale .git (or none) whose HEAD
    # is not the commit its files come from; the manifest carried with it (scripts/tree_manifest.py) says whether
    # its files are that commit's
    if os.environ.get("CLO_GIT_COMMIT") or not commit:
        claimed = os.environ.get("CLO_GIT_COMMIT", "unknown")
        return {
            "commit": claimed,
            **manifest_check(repo, claimed),
            "from": "CLO_GIT_COMMIT",
            "local_git_head": commit or None,
        }
    if changed is None:
        return {"commit": commit, "dirty": None}
    return {"commit": commit, "dirty": bool(changed), "changed": changed[:20]}


# what decides what a run computes, as scripts/tree_manifest.py counts it: the code and its configuration; results
# and data files are a run's outputs or inputs (a sweep that rewrites its own records leaves the code clean)
CODE_SUFFIXES = (".py", ".yaml", ".sh", ".toml", ".cfg")


def code_files(paths: list[str]) -> list[str]:
    return sorted(p for p in paths if p.endswith(CODE_SUFFIXES) and not p.startswith("results/"))


@functools.cache
def _manifest_check(repo: Path, claimed: str) -> tuple[tuple[str, Any], ...]:
    path = repo / ".tree_manifest.json"
    if not path.is_file():
        return (("dirty", None), ("tree", "no .tree_manifest.json: not checked"))
    manifest = json.loads(path.read_text())
    if not manifest["commit"].startswith(claimed) or not claimed or claimed == "unknown":
        return (("dirty", None), ("tree", f"the manifest is of {manifest['commit'][:12]}, not of {claimed}"))
    changed = sorted(p for p, blob in manifest["files"].items() if _blob_id(repo / p) != blob)
    return (
        ("dirty", bool(changed)),
        ("tree", f"{len(manifest['files'])} code files checked"),
        ("changed", changed[:20]),
    )


def manifest_check(repo: Path, claimed: str) -> dict[str, Any]:
    """Whether the code files here are the claimed commit's, by their git blob ids against the manifest (once a
    process: a sweep's jobs share the tree)."""
    return dict(_manifest_check(repo, claimed))


def _blob_id(path: Path) -> str | None:
    """git's id of the file's content (sha1 of "blob <size>\\0" + content); None for a missing file."""
    if not path.is_file():
        return None
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


THREAD_ENV_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "NUMBA_")


def package_version(distribution: str) -> str | None:
    """An installed distribution's version, read from its metadata: importing the package to read its __version__
    would cost every forked sweep job that does not use it a second or more (flashinfer, transformers)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": package_version("transformers"),
        "device": str(device),
        # which physical GPU a job of a multi-GPU sweep ran on (experiments.runner.gpu_assign pins it here)
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "pid": os.getpid(),  # jobs of a job_process=fresh sweep each have their own
        "git": git_commit(ROOT),
        # the thread runtimes' settings (OpenMP, numba, MKL): host-bound steps change with them
        "thread_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(THREAD_ENV_PREFIXES)},
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        env["gpu_mem_total_gb"] = round(torch.cuda.get_device_properties(device).total_memory / 1024**3, 1)
    env["flashinfer"] = package_version("flashinfer-python")
    return env


def failure_environment(cfg) -> dict[str, Any]:
    """A failed or refused run's environment: the device it asked for where that resolves, else this machine's
    default (a refusal may be of the device setting itself)."""
    name = str(cfg.get("device", "auto"))
    try:
        device = torch.device(name if name != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            device = torch.device("cpu")
    except (RuntimeError, TypeError):
        device = torch.device("cpu")
    return environment(device)


def refuse(e: ConfigError) -> NoReturn:
    """The one way bad input ends a command: one `error:` line on stderr, exit status 2."""
    print(f"error: {one_line(e)}", file=sys.stderr)
    sys.exit(2)


def write_measurement(measure, cfg, out) -> tuple[dict, Path]:
    """A measuring command's body: data = measure(cfg), written atomically to out(data) (a Path). A ConfigError
    (also one wrapped by hydra.utils.instantiate) is printed and exits with status 2 before anything is written."""
    try:
        data = measure(cfg)
    except Exception as e:
        err = config_error(e)
        if err is None:
            raise
        refuse(err)
    path = out(data)
    write_json_atomic(path, data)
    return data, path


def _select(config, key: str):
    from omegaconf import OmegaConf

    return OmegaConf.select(config, key) if config is not None else None


class SweepSummary(Callback):
    """A --multirun's end: one table on stderr, a line per job (the overrides that tell it from the others; ok,
    skipped, or failed, cancelled or timeout with its error), and exit status 1 when any job did not end ok or
    skipped. A job's task returns {"status": <one of STATUSES>, "error": ...}; any other return counts as ok, an
    exception as failed.
    A launcher may run the jobs in other processes (joblib's workers, Slurm's nodes), where this callback's
    on_job_end runs too: each job's row goes to <its output dir>/job_outcome.json, and the sweep's end reads the
    rows of this sweep (its id travels to the workers with the pickled callback) from hydra.sweep.dir."""

    OUTCOME = "job_outcome.json"
    # interrupted: the job a Ctrl-C stopped; cancelled and timeout: a Slurm job that scancel or its time limit ended
    # (experiments.runner.slurm_launcher)
    STATUSES = ("ok", "skipped", "failed", "interrupted", "cancelled", "timeout")
    # The sweep under way in this process: a Ctrl-C ends Hydra's launcher before on_multirun_end, and the run
    # command's handler prints this sweep's table instead (interrupted_table).
    running: SweepSummary | None = None

    def __init__(self) -> None:
        self.jobs: list[tuple[int, list[str], str, str]] = []
        self.sweep: str | None = None
        self.current: tuple[int, list[str]] | None = None  # the job started here and not yet ended

    def on_multirun_start(self, config, **kwargs: Any) -> None:
        import uuid

        self.jobs = []
        self.sweep = uuid.uuid4().hex  # tells this sweep's rows from an earlier sweep's in the same folder
        SweepSummary.running = self

    def on_job_start(self, config, **kwargs: Any) -> None:
        num = int(config.hydra.job.get("num", len(self.jobs)) or 0)
        self.current = (num, list(config.hydra.overrides.task))

    def interrupted_table(self) -> str:
        """The table of a sweep stopped by Ctrl-C: the jobs that ended and the one it stopped (interrupted), then
        a line that says so: the jobs after them did not run, and running the command again resumes it."""
        rows = list(self.jobs)
        if self.current is not None:
            rows.append((*self.current, "interrupted", ""))
        self.jobs, self.current, SweepSummary.running = rows, None, None
        end = "[sweep] stopped by Ctrl-C: no later job ran; the same command resumes it (finished jobs are skipped)"
        return f"{self.table()}\n{end}" if rows else end

    def on_job_end(self, config, job_return, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        num = int(config.hydra.job.get("num", len(self.jobs)) or 0)
        outcome = job_return._return_value  # .return_value re-raises a failed job's exception
        if job_return.status != JobStatus.COMPLETED:
            status = "timeout" if slurm_timed_out(outcome) else "failed"
            error = f"{type(outcome).__name__}: {one_line(outcome)}"
        elif isinstance(outcome, dict) and outcome.get("status") in self.STATUSES:
            status, error = outcome["status"], outcome.get("error") or ""
        else:
            status, error = "ok", ""
        row = (num, list(job_return.overrides or []), status, error)
        self.jobs.append(row)
        self.current = None
        out_dir = _select(config, "hydra.runtime.output_dir")
        if self.sweep is not None and out_dir:
            write_json_atomic(Path(str(out_dir)) / self.OUTCOME, {"sweep": self.sweep, "row": list(row)})

    def on_multirun_end(self, config, **kwargs: Any) -> None:
        SweepSummary.running = None
        rows = {num: (num, ov, st, err) for num, ov, st, err in self.jobs}
        sweep_dir = _select(config, "hydra.sweep.dir")
        for path in Path(str(sweep_dir)).rglob(self.OUTCOME) if sweep_dir else []:  # the jobs other processes ran
            try:
                saved = read_json(path)
            except RecordError:
                continue
            if isinstance(saved, dict) and saved.get("sweep") == self.sweep:
                num, ov, st, err = saved["row"]
                rows.setdefault(num, (num, ov, st, err))
        self.jobs = [rows[n] for n in sorted(rows)]
        if not self.jobs:
            return
        failed = any(status not in ("ok", "skipped") for _, _, status, _ in self.jobs)
        print(self.table(), file=sys.stderr, flush=True)
        self.jobs = []
        if failed:
            sys.exit(1)

    def table(self) -> str:
        def hidden(o: str) -> bool:  # where the sweep writes: the same for every job, and long
            return re.split(r"[./=]", o.lstrip("+~"))[0] in ("hydra", "results_dir")

        overrides = [ov for _, ov, _, _ in self.jobs]
        common = set.intersection(*map(set, overrides)) if len(overrides) > 1 else set()
        rows = [
            (str(num), status, " ".join(o for o in ov if o not in common and not hidden(o)) or "(no overrides)", error)
            for num, ov, status, error in self.jobs
        ]
        counts = {s: sum(r[1] == s for r in rows) for s in self.STATUSES}
        jobs = f"{len(rows)} job" + ("s" if len(rows) != 1 else "")
        shared = [o for o in overrides[0] if o in common and not hidden(o)]
        # ok, skipped and failed always; interrupted, cancelled and timed-out jobs where there are any
        said = [f"{counts[s]} {s}" for s in self.STATUSES if s in ("ok", "skipped", "failed") or counts[s]]
        head = f"[sweep] {jobs}: {', '.join(said)}" + (f" (all with {' '.join(shared)})" if shared else "")
        w0 = max(len(r[0]) for r in rows)
        w1 = max(7, *(len(r[1]) for r in rows))
        w2 = max(len(r[2]) for r in rows)
        lines = [head] + [
            f"  #{n:<{w0}}  {s:<{w1}}  {ov:<{w2}}" + (f"  error: {e}" if e else "") for n, s, ov, e in rows
        ]
        return "\n".join(line.rstrip() for line in lines)
