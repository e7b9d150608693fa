"""The comparison report, results/REPORT.md: plots.report writes it (and `python -m plots.all` runs it after the
figures); this name stays for the commands and docs that call it.

    python -m experiments.report [--results results] [--out results/REPORT.md]
"""

from plots.records import cli
from plots.report import main, report

__all__ = ["main", "report"]

if __name__ == "__main__":
    cli(main)
