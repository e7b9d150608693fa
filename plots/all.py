"""Rebuild every figure and table that has records under the results folder, PNG and PDF, the paper's numbers
beside ours wherever it gives them. One line per figure: ok (its records and commit), `no records yet: <folder>`
(its producer has not run), or failed (why: mixed commits, an unknown system...); the others are still drawn,
and the exit status is 1 if any failed. Beside each figure drawn, <name>.caption.md: what it shows and the
commit of each record it was drawn from (a figure's titles name none). A results folder that does not exist is
refused (exit 2). It reads a results/-style tree, each figure from its own folder (FIGURES below:
fig10_throughput/, tab4_hit_rate/, ...); a sweep's own folder is drawn by that figure's module, e.g.
`python -m plots.fig10_throughput <folder> --out fig10`.

It is the one command that regenerates everything drawn or written from the records: when every figure drew,
it then writes <results>/REPORT.md (plots.report) and every results README's generated blocks (plots.readmes).
With the same records it gives the same bytes (tests/test_regenerate.py).

    python -m plots.all [--results results] [--out <results>/figures]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from plots import readmes, report
from plots.figures import FIGURES, Figure
from plots.records import NoRecords, RecordError, cli, commit_of, find, fit_refusal, load_files

REFUSED = "refused before running (the preflight's estimate: no run, no commit)"


def commits_of(folder: Path) -> str:
    try:
        return load_files(folder, "*.json", lambda r: "environment" in r, allow_mixed=True).commit
    except RecordError:
        return "?"


def drawn_record(rec: dict) -> bool:
    """A record a figure draws: a finished run or a benchmark's rows (not a crash), stamped with its commit."""
    return "environment" in rec and rec.get("status", "ok") == "ok"


def files_by_commit(folder: Path) -> dict[str, list[str]]:
    """commit -> the files of folder's drawn records made at it; the preflight's refusals (nothing ran, so no
    commit) under 'refused before running'."""
    by: dict[str, list[str]] = {}
    for r in find(folder, "*.json", lambda r: drawn_record(r) or fit_refusal(r), "records"):
        key = (commit_of(r["record"]) or "no commit") if drawn_record(r["record"]) else REFUSED
        by.setdefault(key, []).append(r["file"])
    return dict(sorted(by.items(), key=lambda kv: (kv[0] == REFUSED, kv[0])))


def caption(f: Figure, results: Path) -> str:
    """The caption written beside a figure: what it is, and the commit of every record it was drawn from. The
    figure's own titles name no commit (save refuses them): a reader of a paper needs what, not where."""
    lines = [f"**{f.name}**: {f.what}.", "", "Drawn by `python -m plots.all` from these records:"]
    for folder in f.folders:
        readme = " (its README.md says how they were made)" if (results / folder / "README.md").exists() else ""
        lines += ["", f"`{results.name}/{folder}/`{readme}:"]
        for commit, files in files_by_commit(results / folder).items():
            head = commit if commit == REFUSED else f"commit {commit}"
            lines.append(f"- {head}, {len(files)} file(s): " + ", ".join(f"`{x}`" for x in files))
    return "\n".join(lines) + "\n"


def build(results: Path, out: Path, figures=FIGURES, log=print) -> dict[str, str]:
    """Draws each figure whose folder has records; returns name -> 'ok' | 'no records' | 'failed: <why>'."""
    status = {}
    for f in figures:
        folder = results / f.folder
        try:
            f.plot(folder, out / f.name, **f.options)
        except NoRecords:
            status[f.name] = "no records"
            log(f"no records yet: {folder}")
        except (RecordError, KeyError, TypeError, ValueError) as e:  # a record without a field a figure reads
            why = str(e) if isinstance(e, RecordError) else f"{type(e).__name__}: {e} (a record lacks a field?)"
            status[f.name] = f"failed: {why}"
            log(f"failed: {f.name} ({folder}): {why}")
        else:
            status[f.name] = "ok"
            (out / f"{f.name}.caption.md").write_text(caption(f, results))
            mixed = ", each file's in its caption" if f.options.get("allow_mixed") else ""
            log(f"ok: {f.name} <- {folder} (commit {commits_of(folder)}{mixed}) -> {out / f.name}.png, .pdf")
    return status


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=Path("results"), help="a results/-style tree of figure folders")
    ap.add_argument("--out", type=Path, default=None, help="where the figures go (default: <results>/figures)")
    args = ap.parse_args(argv)
    if not args.results.is_dir():
        raise NoRecords(f"no results folder {args.results}")
    figures = args.out or args.results / "figures"
    status = build(args.results, figures)
    if all(s == "no records" for s in status.values()):
        raise NoRecords(
            f"no figure has records under {args.results}: it reads a results/-style tree of figure folders; draw a "
            "sweep's folder with its figure's module (python -m plots.fig10_throughput <folder>)"
        )
    if any(s.startswith("failed") for s in status.values()):
        print("REPORT.md and the READMEs not written: a figure failed", file=sys.stderr)
        sys.exit(1)
    out = args.results / "REPORT.md"
    out.write_text(report.report(args.results, out, figures))
    print(f"wrote {out}")
    readmes.run(args.results, check=False)


if __name__ == "__main__":
    cli(main)
