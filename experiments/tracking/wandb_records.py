"""Committed decode records logged to Weights & Biases after the fact. The GPU machine runs without wandb (and
without a network), so its runs reach `results/` as records only; this logs each finished decode record of a
results folder as the W&B run `experiments.run` would have logged (experiments/runner/wandb_log.py), offline without
WANDB_API_KEY (`wandb sync` uploads it later). The W&B group is the folder's name unless --group says otherwise,
so that `experiments.tracking.wandb_report --group <folder>` builds that comparison's report.

    python -m experiments.tracking.wandb_records results/fig10_throughput
    python -m experiments.tracking.wandb_records results/fig2_breakdown_128k --group fig2_breakdown --mode online

Refusals (no metrics) and accuracy records (lm-eval scores, not decode steps) are counted and skipped. Each call
logs new runs: calling it twice on a folder logs its records twice."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omegaconf import OmegaConf

from experiments.runner.wandb_log import log_wandb
from kvoffload.paths import repo_path
from plots.records import RecordError, find

CONFIG = repo_path("conf/config.yaml")  # the run command's wandb defaults (project, entity, dir)


def is_decode_record(rec: dict) -> bool:
    return rec.get("status") == "ok" and "metrics" in rec and "steps" in rec


def choices_of(rec: dict) -> dict[str, str]:
    """The Hydra choices a record's run made, as experiments.run passes them to log_wandb: its system and model,
    and its experiment bundle from `+experiment=...` among its overrides."""
    out = {"system": rec["system"], "model": rec["model"]}
    for o in rec.get("overrides", []):
        key, _, value = o.lstrip("+").partition("=")
        if key in ("experiment", "workload", "ablation"):
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.tracking.wandb_records", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("folder", type=Path, help="a results folder; its records are found recursively")
    ap.add_argument("--group", default=None, help="W&B group (default: the folder's name)")
    ap.add_argument("--project", default=None, help="W&B project (default: the run command's wandb.project)")
    ap.add_argument("--mode", default="auto", choices=("auto", "online", "offline"))
    ap.add_argument("--dir", default=".", help="where wandb writes its ./wandb folder")
    args = ap.parse_args(argv)
    try:
        found = find(args.folder, "record*.json", is_decode_record, "finished decode records")
    except RecordError as e:  # NoRecords too: a folder with none
        print(f"error: {e}", file=sys.stderr)
        return 2
    skipped = sum(1 for _ in args.folder.rglob("record*.json")) - len(found)
    wandb = OmegaConf.load(CONFIG).wandb
    wandb.update(group=args.group or args.folder.resolve().name, mode=args.mode, dir=args.dir)
    if args.project:
        wandb.project = args.project
    cfg = OmegaConf.create({"wandb": wandb})
    logged = sum(log_wandb(cfg, r["record"], Path(r["path"]).stem, choices_of(r["record"])) for r in found)
    group = wandb.group
    print(f"[wandb] {logged} of {len(found)} records logged to group {group!r} ({skipped} skipped: no decode metrics)")
    return 0 if logged == len(found) else 1


if __name__ == "__main__":
    sys.exit(main())
