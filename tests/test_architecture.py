"""The layers of pyproject.toml's import-linter contracts: kernels under the seam and the shared offloading
plumbing, systems over them, the runner and plots on top; no cycles."""

import os

import pytest

from kvoffload.paths import ROOT

lint_imports = pytest.importorskip("importlinter.cli").lint_imports  # a dev tool: absent on the GPU machine


def test_import_contracts_hold(capsys):
    cwd = os.getcwd()
    os.chdir(ROOT)  # lint-imports reads pyproject.toml from the working directory
    try:
        code = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True)
    finally:
        os.chdir(cwd)
    assert code == 0, capsys.readouterr().out
