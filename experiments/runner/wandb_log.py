"""A finished run's record, logged to Weights & Biases: online when WANDB_API_KEY is set, offline otherwise (the run
lands under <wandb.dir>/wandb/offline-run-*, `wandb sync` uploads it later). The record on disk is the result; W&B
is a view of it, so a failure here (wandb not installed, a network error, a bad key) is one warning on stderr and
the run still counts as done."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

# Top-level config keys that say where or how a run is reported, not what it measures (records.NOT_IDENTITY's
# spirit): they stay out of W&B's config, where every key is a column to filter and group by.
NOT_CONFIG = ("results_dir", "force", "wandb", "trace_dir")
# Generous next to a healthy init (~3 s offline), short next to a run: an online init that cannot reach the
# server gives up after this long instead of wandb's default 90 s.
INIT_TIMEOUT_S = 60


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"system": {"eta": 0.8}} -> {"system.eta": 0.8}; lists stay values. Keys starting with '_' (Hydra's
    `_target_`) are dropped: they name a class, not a setting."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if str(k).startswith("_"):
            continue
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def run_config(rec: dict, choices: dict[str, Any]) -> dict[str, Any]:
    """W&B's config of a run: one flat key per setting, dotted (`system.eta`, `workload.prompt`), so that every
    sweep axis is a column; `system`, `model` and `workload` are the names chosen (resolved: `seqlen` in tokens,
    `decode_mode` as run), `experiment` the bundle (None without one)."""
    cfg = {k: v for k, v in rec["config"].items() if k not in NOT_CONFIG}
    flat = flatten(cfg)
    flat.update(
        system=rec["system"],
        model=rec["model"],
        workload=choices.get("workload"),
        experiment=choices.get("experiment"),
        seqlen=rec["seqlen"],
        batch=rec["batch"],
        decode_mode=rec["decode_mode"],
        weights=rec["weights"],
        device=rec["environment"]["device"],
        commit=rec["environment"]["git"]["commit"],
    )
    if "ablation" in choices:
        flat["ablation"] = choices["ablation"]
    return flat


def run_group(wandb_cfg, rec: dict, choices: dict[str, Any]) -> str:
    """wandb.group when set; else the experiment bundle (`+experiment=fig2_breakdown`: its runs are compared);
    else <model>-<workload>, the runs that share what they run."""
    if wandb_cfg.get("group"):
        return str(wandb_cfg.group)
    if choices.get("experiment"):
        return str(choices["experiment"])
    return f"{rec['model']}-{choices.get('workload') or 'decode'}"


# wandb.init's modes that a run may ask for, and auto (wandb's `shared` is for a run written by several processes).
MODES = ("auto", "online", "offline", "disabled")


def resolve_mode(mode: str) -> str:
    if mode == "auto":
        return "online" if os.environ.get("WANDB_API_KEY") else "offline"
    return mode


def log_wandb(cfg, rec: dict, name: str, choices: dict[str, Any]) -> bool:
    """Logs one finished run and says on stderr where it went (a URL, or the offline folder that `wandb sync`
    uploads); True when it was logged, False (after one warning line) when it was not."""
    try:
        where = _log(cfg.wandb, rec, name, choices)
        print(f"[wandb] {where}", file=sys.stderr)
        return True
    except Exception as e:  # noqa: BLE001 - any failure of the view must leave the run done
        message = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
        print(
            f"[wandb] warning: not logged ({type(e).__name__}: {message}); the record is written, the run is done",
            file=sys.stderr,
        )
        return False


def _log(wandb_cfg, rec: dict, name: str, choices: dict[str, Any]) -> str:
    """Logs the run; returns where it went."""
    import wandb  # lazy: GPU machines may run without it, and the import costs a second

    m = rec["metrics"]
    mode = resolve_mode(wandb_cfg.mode)
    run = wandb.init(
        project=wandb_cfg.project,
        entity=wandb_cfg.get("entity") or None,
        group=run_group(wandb_cfg, rec, choices),
        job_type=rec["system"],
        name=name,
        mode=mode,
        config=run_config(rec, choices),
        dir=str(Path(wandb_cfg.dir).resolve()),
        reinit="finish_previous",
        settings=wandb.Settings(silent=True, init_timeout=INIT_TIMEOUT_S),
    )
    try:
        for i, s in enumerate(rec["steps"]):
            run.log(
                {"step_ms": s["phase_ms"]["total"], **{f"phase_ms/{k}": v for k, v in s["phase_ms"].items()}}, step=i
            )
        phases = m["phase_ms_per_step"]
        run.log(
            {
                "phase_breakdown": wandb.Table(
                    columns=["system", "phase", "ms_per_step"],
                    data=[[rec["system"], k, v] for k, v in phases.items() if k != "total"],
                )
            }
        )
        # After the steps' history: the summary holds the record's means, not the last step's values.
        run.summary.update({k: v for k, v in m.items() if not isinstance(v, dict)})
        run.summary.update({f"phase_ms/{k}": v for k, v in phases.items()})
        return location(run, mode)
    finally:
        run.finish()


def location(run, mode: str) -> str:
    """Where a W&B run went: its page online; offline its folder (run.dir is the folder's files/)."""
    if mode == "disabled":
        return "not logged: wandb.mode=disabled"
    if mode == "offline":
        folder = Path(run.dir).parent
        return f"logged offline to {folder} (upload it with `wandb sync {folder}`)"
    return f"logged to {run.url}"
