"""The one run command: `python -m experiments.run [group=option ...] [--multirun]`.

Each run writes results/runs/<name>/record.json (composed config, environment, metrics); <name> is its overrides
as resolved values (records.run_identity). A run whose record ended ok, or refused the point for its fit at this
commit, is skipped (records.finished; force=true repeats it); in a sweep a failing run records its error and the
sweep goes on, and the sweep ends with a table of its jobs (records.SweepSummary) and exit status 1 if any failed.
Bad input (a ConfigError wherever it is raised, an unknown key) ends a single run with one `error:` line and exit
status 2, before any long work. Ctrl-C ends a run with one line, a sweep with its table, and exit status 130."""

from __future__ import annotations

import os
import signal
import sys
import traceback
from pathlib import Path
from typing import NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from experiments.runner import cli_checks, run_settings
from experiments.runner.job_process import hydra_flags, run_in_forked_child, run_in_fresh_process
from experiments.runner.records import (
    SweepSummary,
    config_error,
    failure_environment,
    finished,
    one_line,
    record_path,
    refuse,
    run_identity,
    slurm_timed_out,
)
from experiments.runner.wandb_log import log_wandb
from kvoffload.errors import ConfigError
from kvoffload.offload.host import huge_pages_enabled, thp_env
from kvoffload.paths import write_json_atomic


def summary(rec: dict) -> str:
    m = rec["metrics"]
    ph = m["phase_ms_per_step"]
    ans = rec["answer"]
    found = {True: "FOUND", False: "NOT found", None: "n/a"}[ans["found"]]
    if ans["found"] is False and cut_off(ans["text"] or "", ans["expected"]):
        found += " (cut off: the text ends in its first digits; a larger workload.gen_tokens lets it finish)"
    prefill = (
        f"   prefill {m['prefill_s']:.2f} s ({m['prefill_tokens_per_s']:.0f} tok/s);"
        if m["prefill_tokens_per_s"] is not None
        else f"   KV filled by projection in {m['prefill_s']:.2f} s (no prefill measured);"
    )
    lines = [
        f"== {rec['system']} | {rec['model']} ({rec['weights']}) | {rec['prompt']['kind']} prompt of "
        f"{rec['prompt']['tokens']} tokens x batch {rec['batch']} on {rec['environment']['device']}",
        f"   answer: {found} (expected {ans['expected']}, generated {ans['text']!r})",
        prefill + f" decode {m['decode_tokens_per_s']:.2f}"
        f" tok/s, {m['decode_ms_per_step']:.2f} ms/step = {m['step_over_floor']:.2f}x the dense memory floor "
        f"({m['dense_floor_ms_per_step']:.3f} ms at {m['bandwidth_gb_s']:.0f} GB/s)",
        "   per step (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in ph.items()),
        *(
            [
                "   the system's own floor (device bytes it reads + link bytes it moves + its own CPU work): "
                f"{m['system_floor_ms_per_step']:.3f} ms ("
                + " + ".join(f"{k} {v:.3f}" for k, v in m["system_floor_parts_ms"].items())
                + f"); step = {m['step_over_system_floor']:.2f}x it"
            ]
            if m.get("system_floor_ms_per_step")
            else []
        ),
        f"   KV memory: device {m['kv_device_gb']:.3f} GB, host {m['kv_host_gb']:.3f} GB; hit rate "
        f"{'n/a' if m['hit_rate'] is None else round(m['hit_rate'], 3)};"
        f" host->device {m['bytes_h2d_per_step'] / 1e6:.2f} MB/step",
    ]
    link = rec.get("link") or {}
    if link.get("cap_gb_s") is not None:  # hardware.link_gb_s: the cap beside what it let through
        got = ", ".join(f"{k} {v:.2f}" for k, v in link["achieved_gb_s"].items())
        lines.append(
            f"   link capped at {link['cap_gb_s']:g} GB/s (unpaced bulk {link['bulk_unpaced_gb_s']:.2f}); "
            f"achieved at the start: {got} GB/s"
        )
    return "\n".join(lines)


def cut_off(text: str, expected: str) -> bool:
    """Whether the generation stopped inside the answer: its text ends in the answer's first two or more
    characters."""
    end = text.rstrip()
    return any(end.endswith(expected[:i]) for i in range(2, len(expected)))


def task(cfg: DictConfig) -> dict:
    """One run; returns its outcome for the sweep's summary: {"status": "ok" | "skipped" | "failed" | "timeout"
    (a Slurm job stopped at its time limit), "error", "record"}."""
    hc = HydraConfig.get()
    overrides = list(hc.overrides.task)
    choices = dict(hc.runtime.choices)
    identity = run_identity(cfg, overrides, choices)
    run_settings.check_output_paths(cfg)  # the record is written after the long work: where it goes, checked first
    path = record_path(Path(cfg.results_dir), identity)
    if finished(path) and not run_settings.switch(cfg.force, "force"):
        print(f"[run] skip: {path} exists (force=true repeats it)", file=sys.stderr)
        return {"status": "skipped", "error": None, "record": str(path)}
    in_sweep = hc.mode == RunMode.MULTIRUN
    mode = run_settings.choice(cfg.job_process, "job_process", run_settings.JOB_PROCESSES) if in_sweep else "inline"
    if mode == "fresh":  # with glibc's huge-page tunable as the job's settings ask (the sweep may mix them)
        env = thp_env(
            dict(os.environ),
            on=run_settings.switch(cfg.hardware.get("pin_huge_pages", False), "hardware.pin_huge_pages"),
        )
        return run_in_fresh_process(hydra_flags(hc), overrides, path, hc.runtime.output_dir, env)
    job = lambda: run_job(cfg, path, overrides, identity, choices, in_sweep)  # noqa: E731
    return run_in_forked_child(job, overrides, path) if mode == "fork" else job()


def run_job(cfg: DictConfig, path: Path, overrides: list[str], identity: list[str], choices: dict, in_sweep: bool):
    """The run itself, in this process: its record (a failed one too), its summary and its W&B log."""
    from experiments.runner.execute import execute  # after Hydra has parsed: keeps --help and bad overrides fast

    system_name = choices.get("system", "?")
    base = {
        "run": path.parent.name,
        "overrides": overrides,
        "identity": identity,
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    try:
        rec = {"status": "ok", **base, **execute(cfg, system_name)}
    except Exception as e:  # noqa: BLE001 - recorded, then re-raised or survived (multirun)
        err = config_error(e)
        kind, message = (
            ("config", one_line(err)) if err is not None else ("crash", one_line(f"{type(e).__name__}: {e}"))
        )
        if slurm_timed_out(e):  # hydra/launcher=slurm: the job reached its time limit; a rerun runs it again
            kind, message = "timeout", f"the Slurm job reached its time limit (hydra.launcher.timeout_min): {message}"
        failed = {"status": "failed", "error_kind": kind, "error": message, "traceback": traceback.format_exc()}
        # the commit and environment too: a refusal is a result (drawn as the paper draws OOM) and a resumed sweep
        # keeps it
        write_json_atomic(path, {**failed, "environment": failure_environment(cfg), **base})
        if in_sweep:
            print(f"[run] FAILED ({kind}): {message}\n      recorded in {path}; the sweep continues", file=sys.stderr)
            return {"status": "timeout" if kind == "timeout" else "failed", "error": message, "record": str(path)}
        if err is not None:
            refuse(err)
        raise
    write_json_atomic(path, rec)
    print(summary(rec))
    print(f"[run] record: {path}", file=sys.stderr)
    if cfg.wandb.enabled:
        log_wandb(cfg, rec, path.parent.name, choices)
    return {"status": "ok", "error": None, "record": str(path)}


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    """task(cfg), whose outcome records.SweepSummary reads. The one catch point for bad input: a ConfigError that
    escapes it (task records and refuses those of the run itself; this catches any other, e.g. a bad force=), also
    one Hydra wrapped, is one `error:` line and exit status 2, or in a sweep a failed job."""
    try:
        return task(cfg)
    except Exception as e:
        err = config_error(e)
        if err is None:
            raise
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            print(f"[run] FAILED (config): {one_line(err)}; the sweep continues", file=sys.stderr)
            return {"status": "failed", "error": one_line(err), "record": None}
        refuse(err)
    finally:
        release_memory()


def release_memory() -> None:
    """What a job allocated goes back before the next job of a sweep starts (a job must not inherit the previous
    one's allocations: it would plan under less free memory): its objects (gc breaks the model's and the system's
    reference cycles), the CUDA caching allocator's reserve and its cached pinned host blocks."""
    import gc

    import torch

    from kvoffload.offload.host import empty_host_cache

    gc.collect()
    if torch.cuda.is_initialized():  # is_available() would initialise the driver: a later fork's CUDA would fail
        torch.cuda.synchronize()
        # cuBLAS keeps a workspace per handle and stream it ran on, allocated from the caching allocator and held
        # there, so empty_cache() alone cannot return them
        getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()
        torch.cuda.empty_cache()
        empty_host_cache()


def cli() -> None:
    try:
        checked_main()
    except KeyboardInterrupt:
        interrupted()


def interrupted() -> NoReturn:
    """Ctrl-C (SIGINT): one line, or a sweep's table of what ended and what it stopped, and exit status 130 (128 +
    SIGINT, as a shell reports it) instead of a traceback. A record is written whole or not at all, so a stopped run
    leaves none (its process ends without one: a sweep run again resumes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not break the table in two
    sweep = SweepSummary.running
    message = sweep.interrupted_table() if sweep is not None else "interrupted (Ctrl-C): the run stopped before its end"
    print(f"\n{message}", file=sys.stderr, flush=True)  # after a progress bar's last \r-drawn line
    sys.exit(130)


def checked_main() -> None:
    jobs = cli_checks.refuse_unknown_keys(jobs=True)  # before Hydra composes: a typo or bad value, one line
    pinning = [n for n in jobs if n is not None and n.pin_threads]
    if len({n.pin_huge_pages for n in pinning}) > 1 and any(n.job_process != "fresh" for n in pinning):
        refuse(
            ConfigError(  # glibc's tunables are the process's: only a fresh process per job can differ
                "a sweep mixing hardware.pin_huge_pages=true and false needs job_process=fresh (each job a new "
                "process, started with or without glibc's huge-page tunable)"
            )
        )
    if any(n is not None and n.pin_huge_pages for n in jobs) and not huge_pages_enabled():
        # glibc reads its tunables when a process starts: this command again, in a process that has them
        os.execve(sys.executable, sys.orig_argv, thp_env(dict(os.environ)))
    main()


if __name__ == "__main__":
    cli()
