"""experiments.report: its tables over small fake records (the rows it must write, the files and commit it names),
its refusal of an empty folder, its imports (plots/ and the standard library only), and the committed
results/REPORT.md being the one the committed records give."""

import ast
import sys
from pathlib import Path

import pytest

from experiments import report
from tests.plot_helpers import RESULTS, fig2_folder, refused, run_record, write

ROOT = Path(__file__).resolve().parent.parent


def test_tables_from_fake_records(tmp_path):
    results = tmp_path / "results"
    fig2_folder(results / "fig2_breakdown_128k")
    write(
        results / "tab4_hit_rate",
        {"record_0.json": run_record("clo", **{"metrics.hit_rate": 0.8}), "record_1.json": run_record("retroinfer")},
    )
    text = report.report(results, results / "REPORT.md", results / "figures")
    # FullAttn 10 ms, RetroInfer-style 100 ms: 1000% of it against the paper's 137%, with a sixth in each phase
    assert "| RetroInfer-style | piecewise | 100.00 | 1000.0% | 137.0% | 7.30 | 16.7% | 26.9-36.2% |" in text
    assert "| CLO | graph |" not in text and "| CLO | piecewise | 9.00 | 90.0% | - | - | 16.7% | <1% |" in text
    assert "RetroInfer-style 11.1x, InfiniGen-style 14.4x; the paper: 2.1-5.2x (llama3, Fig. 2/11)" in text
    assert "`fig2_breakdown_128k/record_clo.json`" in text and "(commit abc1234)" in text
    assert "| CLO | 1 | 0.5 | 80.0% | 74.69-84.99% | 0.94-1.07 | 100.0 |" in text
    assert "(figure not built: `python -m plots.all" in text
    assert "- paper Fig. 10: throughput: no records yet (`fig10_throughput/`)" in text


def test_report_refuses_an_empty_folder(tmp_path, capsys):
    (tmp_path / "results").mkdir()
    args = ["--results", str(tmp_path / "results"), "--out", str(tmp_path / "R.md")]
    assert "has records (a results/-style tree" in refused(lambda: report.main(args), capsys)
    assert not (tmp_path / "R.md").exists()
    mixed = fig2_folder(tmp_path / "results" / "fig2_breakdown_128k")
    write(mixed, {"record_clo.json": run_record("clo", "def5678")})
    assert "records of 2 commits" in refused(lambda: report.main(args), capsys)


def test_report_imports_only_plots_and_the_standard_library():
    for path in (ROOT / "experiments" / "report.py", ROOT / "plots" / "report.py", ROOT / "plots" / "markdown.py"):
        tree = ast.parse(path.read_text())
        tops = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        tops |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
        assert tops - {"__future__", "plots"} <= set(sys.stdlib_module_names), (path.name, tops)


def test_committed_report_is_current(tmp_path):
    """results/REPORT.md is regenerated whenever records change (python -m experiments.report)."""
    committed = RESULTS / "REPORT.md"
    if not committed.exists():
        pytest.skip("no committed report")
    text = report.report(RESULTS, committed, RESULTS / "figures")
    assert text == committed.read_text(), "results/REPORT.md is stale: python -m experiments.report"
