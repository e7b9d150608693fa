"""Copies a sweep's run records into a results/ folder under names that say what each point is:
`record_<system>_<seqlen>_b<batch>.json` by default (`--keys` picks the overrides that name it, `--batch-prefix`
the batch's). A point the preflight refused for its fit (the device budget or the host's RAM, with the estimate)
is packed as a run's record is; any other failure (a crash, bad input) is not a result and is listed instead.
Two records that would take one name (a point run twice, at two commits) are refused before anything is
written: results/ holds one record a point. So is a record that would replace a different one already in --out
(the rest of a grid packed beside its first part), unless --replace: a superseded record leaves with a line in
results/LEDGER.md. A fit refusal that repeats the packed one's error word for word (a sweep that ran the point
again) is no new result: the packed record stays.

    python3 scripts/pack_records.py <runs/> [<runs/> ...] --out results/fig10_beyond
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvoffload.paths import write_json_atomic
from plots.records import RecordError, cli, fit_refusal, override_values, read_json, result_record


def point(rec: dict, keys: list[str]) -> dict[str, str] | None:
    """The record's values of `keys`, from its overrides (the run's identity); None if one is missing."""
    given = override_values(rec.get("identity") or rec.get("overrides", []))
    return {k: given[k] for k in keys} if all(k in given for k in keys) else None


def packed_name(values: dict[str, str], batch_prefix: str) -> str:
    parts = [f"{batch_prefix}{v}" if k == "batch" else v for k, v in values.items()]
    return "record_" + "_".join(parts) + ".json"


def read(path: Path) -> dict:
    """A record; RecordError (one error line and exit status 2, by cli) if it is not a readable JSON object."""
    rec = read_json(path)
    if not isinstance(rec, dict):
        raise RecordError(f"{path}: not a JSON object")
    return rec


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path, nargs="+", help="sweep folders (results_dir) holding <run>/record.json")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--keys", default="system,seqlen,batch", help="the overrides that name a point, in order")
    ap.add_argument("--batch-prefix", default="b")
    ap.add_argument("--replace", action="store_true", help="replace records of the same points already in --out")
    args = ap.parse_args(argv)
    keys = [k for k in args.keys.split(",") if k]
    names: dict[str, Path] = {}
    records: dict[str, dict] = {}  # packed name -> record
    failed: list[tuple[Path, dict]] = []
    unnamed: list[Path] = []
    for folder in args.runs:
        if not folder.is_dir():
            print(f"error: {folder}: no such folder", file=sys.stderr)
            sys.exit(2)
        for path in sorted(folder.rglob("record.json")):
            rec = read(path)
            if not result_record(rec):
                failed.append((path, rec))
                continue
            values = point(rec, keys)
            if values is None:
                unnamed.append(path)
                continue
            name = packed_name(values, args.batch_prefix)
            if name in names:
                print(f"error: {names[name]} and {path} are both {name}: pack one of them", file=sys.stderr)
                sys.exit(2)
            names[name], records[name] = path, rec
    if unnamed:
        print(f"error: {unnamed[0]} (and {len(unnamed) - 1} more) override none of {','.join(keys)}", file=sys.stderr)
        sys.exit(2)
    # records of these points already in --out that differ from the new ones
    other = {n: old for n in records if (args.out / n).exists() and (old := read(args.out / n)) != records[n]}
    repeated = [n for n, old in other.items() if fit_refusal(old) and old.get("error") == records[n].get("error")]
    for name in repeated:
        del records[name]
    held = [n for n in other if n in records]
    if held and not args.replace:
        more = f" (and {len(held) - 1} more)" if len(held) > 1 else ""
        print(
            f"error: {args.out / held[0]}{more} holds another record of that point: --replace supersedes it "
            "(say so in results/LEDGER.md)",
            file=sys.stderr,
        )
        sys.exit(2)
    for name, rec in records.items():
        write_json_atomic(args.out / name, rec)
    kept = f"; kept {len(repeated)} packed refusals their runs repeated" if repeated else ""
    print(
        f"packed {len(records)} records into {args.out}{kept}"
        + (f"; not packed: {len(failed)} failed" if failed else "")
    )
    for path, rec in failed:
        error = str(rec.get("error") or "no error recorded").splitlines()[0]
        print(f"  failed: {path}: {error[:160]}")


if __name__ == "__main__":
    cli(main)
