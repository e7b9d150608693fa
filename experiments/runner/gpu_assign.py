"""One GPU per job for a --multirun on one host (hydra/launcher=gpus): Hydra's joblib launcher runs one worker
process per GPU, and this callback pins each worker to its own GPU through CUDA_VISIBLE_DEVICES before its first
job touches CUDA (a CUDA context keeps the device it was created on, so a worker keeps its GPU for all its jobs).

Two kinds of lock, each an exclusive flock on a file in lock_dir, which the OS drops when its holder exits, so a
crashed worker frees its GPU:
- gpu-<id>.worker.lock, held by the worker pinned to the GPU for as long as it lives: a new worker pins itself to a
  GPU that no other worker has, even while that worker is between two jobs;
- gpu-<id>.job.lock, held for the length of a job: jobs never share a GPU. A worker that finds every GPU taken by
  another (more workers than GPUs, or a second sweep on the host) shares one, and its jobs wait for it.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf


def visible_gpus(env: Mapping[str, str] = os.environ) -> list[str]:
    """The GPUs a sweep spreads its jobs over: CUDA_VISIBLE_DEVICES's entries when it is set (indices or UUIDs, as
    given), else one index per GPU that nvidia-smi lists; [] without either. Read without initialising CUDA."""
    if "CUDA_VISIBLE_DEVICES" in env:
        return [g.strip() for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]


def gpu_count(gpus: Sequence[Any] | None = None) -> int:
    """hydra.launcher.n_jobs of hydra/launcher=gpus: one worker per GPU of the pool."""
    return len(gpus) if gpus else len(visible_gpus())


# Registered when Hydra instantiates the callback below, which it does before it instantiates the launcher that
# reads ${gpu_count:...}.
OmegaConf.register_new_resolver("gpu_count", gpu_count, replace=True)


def default_lock_dir() -> Path:
    """Host-wide for one user: two sweeps of one user on one host do not share a GPU either."""
    return Path(tempfile.gettempdir()) / f"clo-gpu-locks-{os.getuid()}"


@dataclass
class Claim:
    gpu: str
    file: IO[bytes]


# This process's GPU once its first job has picked one (CUDA_VISIBLE_DEVICES is set to it), and its worker lock.
_PINNED: str | None = None
_RESERVATION: Claim | None = None


def _lock(lock_dir: Path, gpu: str, kind: str, block: bool) -> Claim | None:
    lock_dir.mkdir(parents=True, exist_ok=True)
    name = "".join(c if c.isalnum() or c in "-_" else "_" for c in gpu)  # a UUID or MIG id as a file name
    f = open(lock_dir / f"gpu-{name}.{kind}.lock", "ab")  # noqa: SIM115 - held open as long as the claim
    try:
        fcntl.flock(f, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
    except BlockingIOError:
        f.close()
        return None
    return Claim(gpu, f)


def reserve(gpus: Sequence[str], lock_dir: Path) -> Claim | None:
    """A GPU of `gpus` that no other worker is pinned to, held for this worker (release() or its exit); None when
    every GPU has its worker."""
    for gpu in gpus:
        c = _lock(lock_dir, gpu, "worker", block=False)
        if c is not None:
            return c
    return None


def claim(gpus: Sequence[str], lock_dir: Path, only: str | None = None, poll_s: float = 0.5) -> Claim:
    """Waits until a GPU of `gpus` (or the GPU `only`) runs no job and holds it for one job, until release()."""
    if not gpus:
        raise ValueError("no GPU to claim: the pool is empty")
    if only is not None:
        return _lock(lock_dir, only, "job", block=True)
    while True:
        for gpu in gpus:
            c = _lock(lock_dir, gpu, "job", block=False)
            if c is not None:
                return c
        time.sleep(poll_s)  # flock cannot wait on "any of N": poll


def release(c: Claim) -> None:
    c.file.close()  # closing the descriptor drops its flock


def pin_worker(gpus: Sequence[str], lock_dir: Path) -> Claim:
    """A job's GPU in this process: on its first job a GPU of its own if one is left (else a shared one), on every
    later job the same GPU; the returned job claim is held until release()."""
    global _PINNED, _RESERVATION
    if _PINNED is not None:
        return claim(gpus, lock_dir, only=_PINNED)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # too late to choose the device: say so
        raise RuntimeError("hydra/launcher=gpus: CUDA was initialised before the job could pick its GPU")
    _RESERVATION = reserve(gpus, lock_dir)
    job = claim(gpus, lock_dir, only=_RESERVATION.gpu if _RESERVATION else None)
    os.environ["CUDA_VISIBLE_DEVICES"] = _PINNED = job.gpu
    return job


class OneGpuPerJob(Callback):
    """hydra.callbacks entry of hydra/launcher=gpus. gpus: the pool (null: visible_gpus() of the launching
    process); lock_dir: null for default_lock_dir()."""

    def __init__(self, gpus: Sequence[Any] | None = None, lock_dir: str | None = None) -> None:
        self.gpus = [str(g) for g in gpus] if gpus else None
        self.lock_dir = Path(lock_dir) if lock_dir else default_lock_dir()
        self._claim: Claim | None = None

    def on_multirun_start(self, config, **kwargs: Any) -> None:
        # In the launching process, before any worker exists: the pool is fixed here and travels to the workers
        # with this object (the launcher pickles its callbacks with each job).
        from experiments.runner.records import refuse
        from kvoffload.errors import ConfigError

        self.gpus = self.gpus or visible_gpus()
        if not self.gpus:
            refuse(
                ConfigError(
                    "hydra/launcher=gpus: no GPU visible (CUDA_VISIBLE_DEVICES is empty or unset and nvidia-smi lists"
                    " none); run the sweep without it, or name the GPUs: hydra.callbacks.one_gpu_per_job.gpus=[0,1]"
                )
            )
        n_jobs = OmegaConf.select(config, "hydra.launcher.n_jobs")
        if n_jobs is not None and int(n_jobs) != len(self.gpus):
            print(
                f"[gpus] warning: hydra.launcher.n_jobs={n_jobs} for {len(self.gpus)} GPUs ({','.join(self.gpus)}):"
                + (" some GPUs stay idle" if int(n_jobs) < len(self.gpus) else " the extra workers wait for a GPU"),
                file=sys.stderr,
            )

    def on_job_start(self, config, **kwargs: Any) -> None:
        if self.gpus is None:  # a job without the sweep's start (a single run): nothing to spread
            return
        self._claim = pin_worker(self.gpus, self.lock_dir)
        num = OmegaConf.select(config, "hydra.job.num")
        print(f"[gpus] job #{num} on GPU {self._claim.gpu} (worker pid {os.getpid()})", file=sys.stderr, flush=True)

    def on_job_end(self, config, job_return, **kwargs: Any) -> None:
        if self._claim is not None:
            release(self._claim)
            self._claim = None
