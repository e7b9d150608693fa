"""Writes .tree_manifest.json: the commit and the git blob id of every tracked code file at it, for a copy of the
tree that has no trustworthy .git (the lent GPU machine's, docs/gpu.md). A run there compares the files it has with
the manifest (experiments.runner.records.git_commit) and records whether the tree matched the commit, instead of
not knowing. Run it before the device call and carry the file:

    python3 scripts/tree_manifest.py        # then run(..., carry=[".whl", ".tree_manifest.json"])
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# what decides what a run computes: the code and its configuration (results and data files are inputs or outputs);
# experiments.runner.records.CODE_SUFFIXES, spelled here so that this script needs no torch
CODE_SUFFIXES = (".py", ".yaml", ".sh", ".toml", ".cfg")


def main() -> int:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout

    commit = git("rev-parse", "HEAD").strip()
    if git("status", "--porcelain", "--untracked-files=no").strip():
        print(
            "error: the tree has uncommitted changes: commit them, so that the manifest names what runs",
            file=sys.stderr,
        )
        return 2
    files = {}
    for line in git("ls-files", "-s").splitlines():  # <mode> <blob> <stage>\t<path>
        meta, path = line.split("\t", 1)
        if path.endswith(CODE_SUFFIXES) and not path.startswith("results/"):
            files[path] = meta.split()[1]
    (ROOT / ".tree_manifest.json").write_text(json.dumps({"commit": commit, "files": files}, indent=0) + "\n")
    print(f"{len(files)} files at {commit[:12]} in .tree_manifest.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
