"""Helpers for the tests that run `python -m experiments.run` in a subprocess (tests/test_run_command.py,
test_run_refusals.py, test_run_sweeps.py and others): the fast overrides, the run itself, the records it wrote,
and the one-line refusal it must give."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAST = ["model.weights=synthetic", "workload.prompt=random", "workload.gen_tokens=4", "wandb.enabled=false"]


def run(*args: str, tmp: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_SILENT": "true", "HYDRA_FULL_ERROR": "0"}
    flags = [a for a in args if a.startswith("--")]  # hydra wants its flags before the overrides
    overrides = [a for a in args if not a.startswith("--")]
    if not any(a.startswith("wandb.dir=") for a in overrides):  # the bundles log to W&B: offline runs stay in tmp
        overrides.append(f"wandb.dir={tmp}")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.run",
            *flags,
            f"results_dir={tmp / 'results'}",
            f"hydra.run.dir={tmp / 'out'}",
            f"hydra.sweep.dir={tmp / 'multi'}",
            *overrides,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def records(tmp: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in (tmp / "results").glob("*/record.json")}


def single_error(p: subprocess.CompletedProcess) -> str:
    """A refused run: exit status 2 and exactly one line on stderr, `error: ...`, before any long work."""
    assert p.returncode == 2, p.stderr[-3000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr[-3000:]
    return lines[0]


def bad(tmp, *args):
    p = run(*args, tmp=tmp, check=False)
    assert p.returncode != 0
    return p.stderr
