"""A markdown comparison report generated from the records under results/: every figure of plots.all (linked
image), and ours-vs-paper tables with ratios (each figure module's table(), beside its plot()), each naming the
record files and the commit it came from. It reads records only: no model, no system, no torch. `python -m
plots.all` writes it after the figures; alone:

    python -m plots.report [--results results] [--out results/REPORT.md]

Bad input (no records at all, records of mixed commits, an unknown system) is one `error:` line, exit 2.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from plots.figures import FIGURES
from plots.markdown import source
from plots.records import NoRecords, RecordError, cli, load_records


def report(results: Path, out: Path, figures: Path) -> str:
    parts, missing = [], []
    for f in FIGURES:
        table = f.table
        try:
            if table:
                body = table(results / f.folder, f.folder)
            else:  # a figure without a table (a phase breakdown): its records, checked as plots.all draws them
                body = source(f.folder, load_records(results / f.folder, allow_mixed=f.options.get("allow_mixed")))
        except NoRecords:
            missing.append(f"- {f.what}: no records yet (`{f.folder}/`)")
            continue
        png = figures / f"{f.name}.png"
        link = os.path.relpath(png, out.parent)
        image = f"![{f.name}]({link})" if png.exists() else f"(figure not built: `python -m plots.all --out {figures}`)"
        parts.append(f"## {f.what}\n\n{image}\n\n{body}")
    if not parts:
        raise NoRecords(f"no figure folder under {results} has records (a results/-style tree: plots.all's folders)")
    head = (
        f"# Ours vs the paper (generated)\n\nWritten by `python -m experiments.report` from the records under "
        f"`{results.name}/`; do not edit by hand. The paper's numbers are `plots/paper.py`'s, each with its figure "
        "or table (`plots/paper.py`).\n"
    )
    tail = "\n\n## Not yet measured\n\n" + "\n".join(missing) if missing else ""
    return head + "\n" + "\n\n".join(parts) + tail + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=Path("results"))
    ap.add_argument("--out", type=Path, default=None, help="default: <results>/REPORT.md")
    ap.add_argument("--figures", type=Path, default=None, help="where plots.all wrote them (<results>/figures)")
    args = ap.parse_args(argv)
    out = args.out or args.results / "REPORT.md"
    if not args.results.is_dir():
        raise RecordError(f"no results folder {args.results}")
    text = report(args.results, out, args.figures or args.results / "figures")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(out)
    print(f"{text.count(chr(10) + '## ')} sections -> {out}")


if __name__ == "__main__":
    cli(main)
