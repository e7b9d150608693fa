"""hydra/launcher=slurm's launch: hydra-submitit-launcher's, with the endings a sweep must report rather than die of
(hydra_plugins/clo_slurm_launcher holds the launcher class, since Hydra takes launchers only from there). Upstream
asks each job for its result, and a job that left none (cancelled with scancel, killed at its time limit, its node
lost) raises there: the sweep ends in a traceback and loses the other jobs' rows. Here such a job is a row of the
sweep's table (cancelled, timeout or failed, with Slurm's state) and the sweep goes on to its end. And where the
cluster keeps no accounting (sacct fails: a small cluster, or scripts/slurm_local.sh's), submitit would never learn
that a job without a result ended; its states then come from squeue, which shows a finished job for MinJobAge
seconds."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import submitit
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher import submitit_launcher
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from omegaconf import OmegaConf, open_dict
from submitit.core.utils import FailedJobError, UncompletedJobError
from submitit.slurm.slurm import SlurmInfoWatcher

from experiments.runner.records import one_line

GONE = "GONE"  # the state of a job squeue no longer shows: ended (a pending array task cancelled leaves no trace)


class SqueueFallbackWatcher(SlurmInfoWatcher):
    """submitit's job states from sacct, else (no accounting) from squeue in sacct's format."""

    def update(self) -> None:
        command = self._make_command()
        if command is None:
            return
        self._num_calls += 1
        try:
            self._info_dict.update(self.read_info(subprocess.check_output(command, stderr=subprocess.PIPE)))
        except (OSError, subprocess.CalledProcessError):
            self._info_dict.update(self.squeue_states())
        self._last_status_check = time.time()
        self._finished |= {j for j in self._registered - self._finished if self.is_done(j, mode="cache")}

    def squeue_states(self) -> dict[str, dict[str, str]]:
        pending = self._registered - self._finished
        try:
            out = subprocess.check_output(
                ["squeue", "--me", "-h", "-r", "-t", "all", "-o", "%i|%T|%N"], stderr=subprocess.PIPE, text=True
            )
        except (OSError, subprocess.CalledProcessError):
            return {}  # the controller is down too: the states stay as they were
        states = self.read_info("JobID|State|NodeList\n" + out)
        return {**{j: {"JobID": j, "State": GONE, "NodeList": ""} for j in pending - set(states)}, **states}


def ending(job: Any, error: Exception) -> tuple[str, str]:
    """(status, message) for a job that returned no result: cancelled, timeout, or failed."""
    state = str(job.watcher.get_state(job.job_id, mode="force")).upper()
    if state.startswith("CANCELLED"):
        return "cancelled", f"Slurm job {job.job_id} was cancelled ({state.lower()}); run the sweep again to resume it"
    if state.startswith("TIMEOUT") or "not requeued because: timed-out" in str(error):  # the job's own word
        return "timeout", f"Slurm job {job.job_id} ran past its time limit (hydra.launcher.timeout_min)"
    lines = [x for x in str(error).splitlines() if x.strip() and not x.startswith("-")]
    tail = one_line(lines[-1]) if lines else type(error).__name__
    return "failed", f"Slurm job {job.job_id} ended without a result (state {state}): {tail}"


def launch(
    launcher: submitit_launcher.SlurmLauncher, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
) -> Sequence[JobReturn]:
    """Upstream's launch (the executor it builds and the array it submits), then each job's result, or for a
    job without one a row saying how it ended."""
    assert launcher.config is not None
    init = {k: v for k, v in launcher.params.items() if k in ("submitit_folder", "max_num_timeout")}
    executor = submitit.AutoExecutor(
        cluster="slurm", folder=init.pop("submitit_folder"), **{f"slurm_{k}": v for k, v in init.items()}
    )
    generic = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(
        **{
            k if k in generic else f"slurm_{k}": v
            for k, v in launcher.params.items()
            if k not in ("submitit_folder", "max_num_timeout")
        }
    )
    Path(str(launcher.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
    nums = [initial_job_idx + i for i in range(len(job_overrides))]
    for num, overrides in zip(nums, job_overrides):
        submitit_launcher.log.info(f"\t#{num} : {' '.join(filter_overrides(overrides))}")
    args = [
        (list(o), "hydra.sweep.dir", n, f"job_id_for_{n}", Singleton.get_state()) for n, o in zip(nums, job_overrides)
    ]
    jobs = executor.map_array(launcher, *zip(*args))  # each job calls launcher(*its args), as upstream's
    watcher = SqueueFallbackWatcher(
        delay_s=600
    )  # upstream's delay: sacct (or squeue) at 0, 2, 4, 8 ... 64 s, then 1/min
    for job in jobs:  # these jobs' states from it, not from the watcher all SlurmJobs share (array tasks are made
        job.watcher = watcher  # as SlurmJob whatever the executor's job_class)
        watcher.register_job(job.job_id)
    returns = []
    for num, overrides, job in zip(nums, job_overrides, jobs):
        try:
            ret = job.results()[0]
        except (UncompletedJobError, FailedJobError) as e:
            ret = unfinished(launcher, num, list(overrides), *ending(job, e))
        if ret.status == JobStatus.FAILED:  # raised past the task: the job's on_job_end wrote its row already;
            # Hydra's sweeper would raise it here, ending the sweep before its table
            ret = JobReturn(
                overrides=ret.overrides,
                cfg=ret.cfg,
                status=JobStatus.COMPLETED,
                _return_value={"status": "failed", "error": one_line(ret._return_value)},
            )
        returns.append(ret)
    return returns


def unfinished(launcher, num: int, overrides: list[str], status: str, message: str) -> JobReturn:
    """The return of a job that never returned: its run's outcome, given to the callbacks as the job's own
    on_job_end would have (the sweep's table reads it there)."""
    config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, overrides)
    with open_dict(config.hydra.job):
        config.hydra.job.num = num
    ret = JobReturn(overrides=overrides, cfg=config, status=JobStatus.COMPLETED)
    ret.return_value = {"status": status, "error": message, "record": None}
    launcher.hydra_context.callbacks.on_job_end(config=config, job_return=ret)
    return ret
