"""ruff's lint and format settings of pyproject.toml hold for the whole tree (CI runs this file)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.paths import ROOT

RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")


@pytest.mark.skipif(RUFF is None, reason="ruff is a dev tool (pip install -e '.[dev]')")
@pytest.mark.parametrize("args", [["check", "--output-format", "concise"], ["format", "--check"]])
def test_ruff(args):
    p = subprocess.run([RUFF, *args, "."], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-1000:]
