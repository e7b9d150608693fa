"""The one run command: `python -m experiments.run [group=option ...] [--multirun]`.

Each run writes results/runs/<name>/record.json (composed config, environment, metrics). A run whose record
exists is skipped (force=true repeats it); in a sweep a failing run records its error and the sweep goes on."""
from __future__ import annotations

import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from kvoffload.errors import ConfigError
from kvoffload.paths import write_json_atomic
from experiments.records import finished, record_path


def summary(rec: dict) -> str:
    m = rec["metrics"]
    ph = m["phase_ms_per_step"]
    ans = rec["answer"]
    found = {True: "FOUND", False: "NOT found", None: "n/a"}[ans["found"]]
    lines = [
        f"== {rec['system']} | {rec['model']} ({rec['weights']}) | {rec['prompt']['kind']} prompt of "
        f"{rec['prompt']['tokens']} tokens x batch {rec['batch']} on {rec['environment']['device']}",
        f"   answer: {found} (expected {ans['expected']}, generated {ans['text']!r})",
        f"   prefill {m['prefill_s']:.2f} s ({m['prefill_tokens_per_s']:.0f} tok/s); decode {m['decode_tokens_per_s']:.2f}"
        f" tok/s, {m['decode_ms_per_step']:.2f} ms/step = {m['step_over_floor']:.2f}x the dense memory floor "
        f"({m['dense_floor_ms_per_step']:.3f} ms at {m['bandwidth_gb_s']:.0f} GB/s)",
        "   per step (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in ph.items()),
        *([f"   the system's own floor (device bytes it reads, link bytes it moves): {m['system_floor_ms_per_step']:.3f}"
           f" ms; step = {m['step_over_system_floor']:.2f}x it"] if m.get("system_floor_ms_per_step") else []),
        f"   KV memory: device {m['kv_device_gb']:.3f} GB, host {m['kv_host_gb']:.3f} GB; hit rate "
        f"{m['hit_rate'] if m['hit_rate'] is not None else 'n/a'}; host->device {m['bytes_h2d_per_step'] / 1e6:.2f} MB/step",
    ]
    return "\n".join(lines)


def log_wandb(cfg: DictConfig, rec: dict, name: str) -> None:
    import os

    import wandb  # lazy: GPU machines run without it

    mode = cfg.wandb.mode
    if mode == "auto":
        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    run = wandb.init(project=cfg.wandb.project, name=name, mode=mode, config=rec["config"],
                     dir=str(Path(cfg.wandb.dir).resolve()), reinit="finish_previous",
                     settings=wandb.Settings(silent=True))
    try:
        run.summary.update({k: v for k, v in rec["metrics"].items() if not isinstance(v, dict)})
        run.summary.update({f"phase_ms/{k}": v for k, v in rec["metrics"]["phase_ms_per_step"].items()})
        for i, s in enumerate(rec["steps"]):
            run.log({"step_ms": s["phase_ms"]["total"], **{f"phase_ms/{k}": v for k, v in s["phase_ms"].items()}},
                    step=i)
    finally:
        run.finish()


def task(cfg: DictConfig) -> dict | None:
    from experiments.execute import execute  # after Hydra has parsed: keeps --help and bad overrides fast

    hc = HydraConfig.get()
    overrides = list(hc.overrides.task)
    path = record_path(Path(cfg.results_dir), overrides)
    if finished(path) and not cfg.force:
        print(f"[run] skip: {path} exists (force=true repeats it)", file=sys.stderr)
        return None
    system_name = hc.runtime.choices.get("system", "?")
    base = {"run": path.parent.name, "overrides": overrides, "config": OmegaConf.to_container(cfg, resolve=True)}
    try:
        rec = {"status": "ok", **base, **execute(cfg, system_name)}
    except Exception as e:  # noqa: BLE001 - recorded, then re-raised or survived (multirun)
        kind = "config" if isinstance(e, ConfigError) else "crash"
        write_json_atomic(path, {"status": "failed", "error_kind": kind, "error": str(e),
                                 "traceback": traceback.format_exc(), **base})
        if hc.mode == RunMode.MULTIRUN:
            print(f"[run] FAILED ({kind}): {e}\n      recorded in {path}; the sweep continues", file=sys.stderr)
            return None
        if isinstance(e, ConfigError):
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        raise
    write_json_atomic(path, rec)
    print(summary(rec))
    print(f"[run] record: {path}", file=sys.stderr)
    if cfg.wandb.enabled:
        log_wandb(cfg, rec, path.parent.name)
    return rec


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    task(cfg)


if __name__ == "__main__":
    main()
