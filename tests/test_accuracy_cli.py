"""The accuracy commands refuse bad input with one `error:` line and exit status 2 before any weight is loaded, and
lm-eval's own command line runs the `clo` model (experiments.accuracy.lm_eval_cli)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.paths import ROOT

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def run(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout
    )


def in_tmp(tmp: Path) -> list[str]:
    """The overrides that keep a run's records and Hydra's own output folders out of the checkout."""
    return [f"results_dir={tmp}", f"hydra.run.dir={tmp / 'out'}", f"hydra.sweep.dir={tmp / 'multi'}"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, says",
    [
        (["experiments.accuracy", "sytem=clo"], "unknown key 'sytem'"),
        (["experiments.accuracy", "workload.lengths=[2x]"], "workload.lengths='2x'"),
        (["experiments.accuracy", "workload.limit=0"], "workload.limit=0 must be at least 1"),
        (
            ["experiments.accuracy.lm_eval_cli", "run", "--model", "clo", "--model_args", "sytem=clo", "--tasks", "x"],
            "sytem",
        ),
    ],
)
def test_bad_input_is_one_error_line(args, says, tmp_path):
    p = run(*args, *(in_tmp(tmp_path) if args[0] == "experiments.accuracy" else ["--limit=1"]))
    assert p.returncode == 2, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and says in last, p.stderr[-2000:]


@pytest.mark.slow
def test_lm_evals_command_line_runs_the_clo_model(tmp_path):
    args = ["run", "--model", "clo", "--model_args", "system=fullattn", "--tasks", "ruler_vt", "--device", "cpu"]
    more = ["--metadata", "max_seq_lengths=[2048]", "--limit", "1", "--output_path", str(tmp_path)]
    p = run("experiments.accuracy.lm_eval_cli", *args, *more, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    (results,) = tmp_path.iterdir()  # in --output_path itself, not a randomly named folder under it
    assert results.name.startswith("results_") and results.suffix == ".json"
    got = json.loads(results.read_text())
    assert 0.0 <= got["results"]["ruler_vt"]["2048,none"] <= 1.0 and got["model_name"] == "clo"
    assert "4096,none" not in got["results"]["ruler_vt"]  # RULER's -1 for a length not run
    rows = [line.replace(" ", "") for line in p.stdout.splitlines() if line.startswith("|")]
    assert any("|2048|" in r for r in rows) and not any("|4096|" in r for r in rows), p.stdout


def test_the_wrapper_saves_into_output_path_without_the_lengths_not_run(tmp_path):
    """What lm-eval's run does with the wrapped simple_evaluate: its tracker logs the model (a random name, clo has
    no `pretrained=`), then saves; the results keep the length run and drop RULER's -1 placeholder."""
    from lm_eval.loggers import EvaluationTracker

    from experiments.accuracy.lm_eval_cli import clo_evaluate

    def simple_evaluate(**kwargs):
        kwargs["evaluation_tracker"].general_config_tracker.log_experiment_args("clo", {}, None, None, False)
        metrics = {"2048,none": 0.5, "2048_stderr,none": 0.1, "4096,none": -1, "4096_stderr,none": "N/A"}
        return {"results": {"ruler_vt": {"alias": "ruler_vt", **metrics}}, "groups": {}}

    tracker = EvaluationTracker(output_path=str(tmp_path))
    results = clo_evaluate(simple_evaluate, "clo")(model="clo", evaluation_tracker=tracker)
    assert results["results"]["ruler_vt"] == {"alias": "ruler_vt", "2048,none": 0.5, "2048_stderr,none": 0.1}
    tracker.save_results_aggregated(results=results, samples=None)
    (saved,) = tmp_path.iterdir()
    assert saved.name.startswith("results_") and json.loads(saved.read_text())["model_name"] == "clo"


@pytest.mark.slow
def test_a_sweep_records_each_jobs_refusal_and_exits_1(tmp_path):
    p = run("experiments.accuracy", "--multirun", "system=fullattn,clo", "workload.limit=0", *in_tmp(tmp_path))
    assert p.returncode == 1, p.stderr[-2000:]
    assert "2 jobs: 0 ok, 0 skipped, 2 failed" in p.stderr and p.stderr.count("must be at least 1") >= 2
    assert len(list(tmp_path.glob("*/record.json"))) == 2


def test_the_readmes_accuracy_commands_pass_the_key_check():
    from experiments.runner.cli_checks import check_override_keys
    from tests.test_config import shown_overrides

    shown = shown_overrides("experiments.accuracy")
    assert "system=fullattn,clo" in shown and "workload.limit=5" in shown
    check_override_keys(shown)
