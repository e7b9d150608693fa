"""`python -m experiments.accuracy [system=...] [workload.tasks=[...]] [workload.lengths=[2k]] [workload.limit=5]`

The accuracy workload (conf/workload/accuracy.yaml, chosen unless the command line names another) with one system;
`--multirun system=fullattn,clo` compares systems. Jobs of one process share the decoder and every prompt's prefill
(systems differ only in decode). Each run writes <results_dir>/<its overrides>/record.json: per task and length the
score and every sample (target, response, score, what it cost), the tasks skipped and why. Bad input is one
`error:` line and exit status 2, before the weights are loaded."""

from __future__ import annotations

import sys
import time
from importlib.metadata import version
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from experiments.accuracy.job import default_workload, run_job
from experiments.accuracy.report import cost_summary, summary_lines
from experiments.runner import cli_checks, run_settings
from experiments.runner.records import environment
from kvoffload.errors import ConfigError


def settings(cfg: DictConfig) -> tuple[list[str], list[int], int | None]:
    """(tasks, lengths in tokens, limit) of the accuracy workload, checked."""
    w = cfg.workload
    if w.get("name") != "accuracy":
        raise ConfigError(f"workload={w.get('name')}: experiments.accuracy runs workload=accuracy")
    tasks = list(w.tasks) if OmegaConf.is_list(w.tasks) else [w.tasks]
    lengths = [
        run_settings.parse_tokens(x, "workload.lengths")
        for x in (w.lengths if OmegaConf.is_list(w.lengths) else [w.lengths])
    ]
    limit = None if w.limit is None else run_settings.integer(w.limit, "workload.limit", 1)
    if not tasks or not lengths:
        raise ConfigError("workload.tasks and workload.lengths must not be empty")
    return tasks, lengths, limit


def run(cfg: DictConfig, system_name: str) -> dict:
    from experiments.accuracy.lm import CLOLM
    from experiments.accuracy.tasks import check_tasks, evaluate, index_for, is_ruler, task_folder

    tasks, lengths, limit = settings(cfg)
    chat = run_settings.switch(cfg.workload.get("apply_chat_template", False), "workload.apply_chat_template")
    tm = index_for(tasks)
    runnable, skipped = check_tasks(tm, tasks)
    for line in skipped:
        print(f"[accuracy] {line}", file=sys.stderr)
    load_at_start = _load_average()
    lm = CLOLM(config=cfg, system_name=system_name)  # loads the weights (or reuses the previous job's)
    lm.backbone.cache.begin_job()
    tokenizer = lm.tokenizer.name_or_path
    if max(lengths) > lm.max_length and any(is_ruler(tm, t) for t in runnable):
        raise ConfigError(f"workload.lengths: {max(lengths)} tokens exceed the model's max_length={lm.max_length}")
    results: dict[str, dict] = {}
    for task in runnable:
        for length in lengths if is_ruler(tm, task) else [None]:
            first, t0 = len(lm.records), time.perf_counter()
            r = evaluate(lm, task, task_folder(tm, task), tokenizer, length, limit, chat)
            costs = {rec["doc_id"]: rec for rec in lm.records[first:] if rec["task"] == task}
            for s in r["samples"]:
                s["cost"] = costs.get(s["doc_id"])
            r["wall_s"] = round(time.perf_counter() - t0, 2)
            results.setdefault(task, {})[str(length or "all")] = r
            print(
                f"[accuracy] {system_name} {task} @ {length or 'all'}: score {r['score']} over {r['n']} samples",
                file=sys.stderr,
            )
    cache = lm.backbone.cache
    return {
        "system": system_name,
        "model": lm.backbone.model_cfg.name,
        "weights": lm.backbone.weights,
        "tasks": results,
        "skipped": skipped,
        "cost_per_sample": cost_summary(results),
        "prefill_cache": {"hits": cache.hits, "misses": cache.misses, "gb_held": round(cache.used / 2**30, 3)},
        "decode_mode": lm.decode_mode,
        "system_state": lm.system_state,
        # a shared machine's load skews the times: its 1/5/15-minute load averages when the run started and ended
        "environment": {
            **environment(lm.device),
            "lm_eval": version("lm_eval"),
            "load_average": {"start": load_at_start, "end": _load_average()},
        },
    }


def _load_average() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


@hydra.main(config_path="../../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    """One accuracy run; its outcome for the sweep's summary (records.SweepSummary)."""
    return run_job("accuracy", cfg, lambda c, system, _: run(c, system), summary_lines)


def cli() -> None:
    default_workload("accuracy")
    cli_checks.refuse_unknown_keys()
    main()


if __name__ == "__main__":
    cli()
