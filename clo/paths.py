"""Where the repository's own files lie: defaults name data files relative to the repository root."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def repo_path(path: str | Path) -> Path:
    """`path` as given when absolute, else under the repository root (so a run works from any directory)."""
    path = Path(path)
    return path if path.is_absolute() else ROOT / path
