"""One job of a model-quality command (experiments.accuracy, experiments.fidelity) under Hydra: its record's path from
its overrides, skip-if-done, bad input as one `error:` line (a single run) or a failed record and row (a sweep,
which goes on), the record written atomically at the end and its summary printed."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from experiments.runner import run_settings
from experiments.runner.records import config_error, finished, one_line, record_path, refuse, run_identity
from kvoffload.paths import write_json_atomic


def run_job(
    tag: str, cfg: DictConfig, body: Callable[[DictConfig, str, list[str]], dict], lines: Callable[[dict], list[str]]
) -> dict:
    """body(cfg, system name, the run's identity) -> the record's content; lines(record) -> its summary. Returns
    the job's outcome for the sweep's table (records.SweepSummary)."""
    hc = HydraConfig.get()
    overrides, choices = list(hc.overrides.task), dict(hc.runtime.choices)
    identity = run_identity(cfg, overrides, choices)
    path = record_path(Path(cfg.results_dir), identity)
    base = {"run": path.parent.name, "overrides": overrides, "config": OmegaConf.to_container(cfg, resolve=True)}
    try:
        if finished(path) and not run_settings.switch(cfg.force, "force"):
            print(f"[{tag}] skip: {path} exists (force=true repeats it)", file=sys.stderr)
            return {"status": "skipped", "error": None, "record": str(path)}
        rec = {"status": "ok", **base, **body(cfg, choices.get("system", "?"), identity)}
    except Exception as e:
        err = config_error(e)
        if err is None or hc.mode != RunMode.MULTIRUN:
            if err is not None:
                refuse(err)
            raise
        print(f"[{tag}] FAILED (config): {one_line(err)}; the sweep continues", file=sys.stderr)
        write_json_atomic(path, {"status": "failed", "error": one_line(err), **base})
        return {"status": "failed", "error": one_line(err), "record": str(path)}
    write_json_atomic(path, rec)
    print("\n".join(lines(rec)))
    print(f"[{tag}] record: {path}", file=sys.stderr)
    return {"status": "ok", "error": None, "record": str(path)}


def default_workload(name: str) -> None:
    """Puts workload=<name> among the command line's overrides unless it names a workload (Hydra's parser takes
    the overrides as one run of positional arguments)."""
    from experiments.runner import cli_checks

    overrides = cli_checks.command_line_overrides(sys.argv[1:])
    if not any(o.split("=", 1)[0].lstrip("+~") == "workload" for o in overrides):
        at = sys.argv.index(overrides[0], 1) if overrides else len(sys.argv)
        sys.argv.insert(at, f"workload={name}")
