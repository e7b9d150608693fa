"""Where the repository's own files lie (defaults name data files relative to the repository root), and the
one way every result and data file is written: atomically, so nothing is ever half-written."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
UMASK = os.umask(0o022)  # the process's umask, read once at import (reading it sets it) and set straight back
os.umask(UMASK)


def repo_path(path: str | Path) -> Path:
    """`path` as given when absolute, else under the repository root (so a run works from any directory)."""
    path = Path(path)
    return path if path.is_absolute() else ROOT / path


def write_json_atomic(path: Path, data: Any) -> None:
    """JSON to a temporary file beside `path`, synced, then renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~UMASK)  # as open() would make it: mkstemp's 0600 hides records from a group
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
