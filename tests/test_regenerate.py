"""One command, `python -m plots.all`, regenerates everything under results/ that is drawn or written from the
records: the figures (PNG and PDF) and their captions, REPORT.md and the READMEs' generated blocks. Run over a copy
of the committed results, it gives the committed files byte for byte: a figure, table or README that was edited by
hand, or not regenerated after its records or its code changed, fails here."""

import shutil
from pathlib import Path

from plots import all as plots_all

RESULTS = Path(__file__).resolve().parent.parent / "results"


def test_plots_all_regenerates_the_committed_figures_report_and_readmes(tmp_path, capsys):
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    shutil.rmtree(results / "figures")  # drawn afresh, so a committed figure nothing draws any more shows
    plots_all.main(["--results", str(results)])
    capsys.readouterr()
    drawn = sorted(p.name for p in (results / "figures").iterdir())
    assert drawn == sorted(p.name for p in (RESULTS / "figures").iterdir())
    written = ["REPORT.md", *(f"figures/{name}" for name in drawn)]
    written += sorted(str(p.relative_to(RESULTS)) for p in RESULTS.glob("**/README.md"))
    stale = [name for name in written if (results / name).read_bytes() != (RESULTS / name).read_bytes()]
    assert not stale, f"regenerated files differ from the committed ones: {stale}; python -m plots.all"
