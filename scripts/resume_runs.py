"""Copies an earlier device call's run records into this call's results folder, so that a sweep cut short by a
call's time limit goes on where it stopped, at the same commit: experiments.run skips a point whose record says
it is done (experiments.runner.records.finished).
Only records of `commit` are taken (a figure is drawn from one commit) that ended ok or are the preflight's refusal
of a point that does not fit, with its estimate (plots.records.fit_refusal: decided before anything is allocated,
from the same estimate, on a machine of the same kind); a crashed point runs again.

    python3 scripts/resume_runs.py <earlier call's runs/> <this call's runs/> <commit>

scripts/gpu_session.sh calls it with RESUME=<folder> (the earlier call's packed runs/, extracted into a git-ignored
folder that the call carries).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from plots.records import RecordError, commit_of, read_json, result_record


def resumable(record: Path, commit: str) -> bool:
    try:
        rec = read_json(record)
    except RecordError:
        return False
    return result_record(rec) and commit_of(rec) == commit[:7]  # not a dirty tree's: commit_of marks it


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("earlier", type=Path)
    ap.add_argument("runs", type=Path)
    ap.add_argument("commit")
    args = ap.parse_args(argv)
    if not args.earlier.is_dir():
        print(f"error: RESUME={args.earlier}: no such folder", file=sys.stderr)
        sys.exit(2)
    records = sorted(args.earlier.rglob("record.json"))
    taken = [r for r in records if resumable(r, args.commit)]
    for record in taken:
        dest = args.runs / record.parent.relative_to(args.earlier)
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy2(record, dest / record.name)
    print(f"resumed {len(taken)} of {len(records)} records (ok or refused, commit {args.commit}) from {args.earlier}")


if __name__ == "__main__":
    main()
