"""Run records: one folder per run under results_dir, named after the run's overrides (so a sweep that is run
again finds its finished runs), holding record.json written atomically."""
from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from kvoffload.errors import ConfigError
from kvoffload.paths import ROOT, write_json_atomic

# Overrides that change where or how a run is reported, not what it measures.
NOT_IDENTITY = ("results_dir", "force", "wandb.", "hydra.")


def run_name(overrides: list[str]) -> str:
    """A readable, filesystem-safe name plus a hash of the overrides that define the run."""
    ident = sorted(o for o in overrides if not o.lstrip("+~").startswith(NOT_IDENTITY))
    digest = hashlib.sha1("\n".join(ident).encode()).hexdigest()[:8]
    readable = ",".join(ident) or "defaults"
    safe = "".join(c if c.isalnum() or c in "=,.-_" else "_" for c in readable)[:120]
    return f"{safe}-{digest}"


def record_path(results_dir: Path, overrides: list[str]) -> Path:
    return results_dir / run_name(overrides) / "record.json"


def finished(path: Path) -> bool:
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("status") == "ok"
    except (OSError, json.JSONDecodeError):
        return False  # a damaged record counts as not done: the run is repeated


def git_commit(repo: Path) -> dict[str, Any]:
    def git(*args: str) -> str:
        p = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10)
        return p.stdout.strip() if p.returncode == 0 else ""

    try:
        commit = git("rev-parse", "--verify", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", None
    # The launcher's word wins: the GPU machine's copy of the tree may carry a stale .git (or none) whose HEAD
    # is not the commit its files come from.
    if os.environ.get("CLO_GIT_COMMIT") or not commit:
        return {"commit": os.environ.get("CLO_GIT_COMMIT", "unknown"), "dirty": None, "from": "CLO_GIT_COMMIT",
                "local_git_head": commit or None}
    return {"commit": commit, "dirty": dirty}


def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "git": git_commit(ROOT),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        env["gpu_mem_total_gb"] = round(torch.cuda.get_device_properties(device).total_memory / 1024**3, 1)
    try:
        import flashinfer

        env["flashinfer"] = flashinfer.__version__
    except ImportError:
        env["flashinfer"] = None
    return env


def write_measurement(measure, cfg, out) -> tuple[dict, Path]:
    """A measuring command's body: data = measure(cfg), written atomically to out(data) (a Path). A ConfigError
    is printed and exits with status 2 before anything is written."""
    try:
        data = measure(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    path = out(data)
    write_json_atomic(path, data)
    return data, path
