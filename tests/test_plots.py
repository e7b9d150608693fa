"""Figures are made from records: each plot over the committed records (its numbers checked against the README
that quotes them) or over small fake records of its producer's format, and every bad input (no records, mixed
commits, an unknown system) refused with one line that names the files, exit status 2. Here: the systems'
labels, the phase breakdown, Figure 2, the link figure, plots.all and the captions naming each figure's commits
(Figure 10: test_plots_fig10.py; Tables 4-6 and the ablations: test_plots_tables.py)."""

import json
import sys

import matplotlib.pyplot as plt
import pytest
from matplotlib.figure import Figure

from kvoffload.kv.timer import PHASES
from plots import all as plots_all
from plots import (
    fig2_breakdown,
    fig3_13_link,
    paper,
)
from plots.phase_breakdown import plot as phase_plot
from plots.records import SYSTEMS, NoRecords, RecordError, load_records, save, titles
from tests.plot_helpers import RESULTS, ROOT, drawn, fig2_folder, fig10_folder, refused, run_record, write


def test_systems_are_the_configured_ones():
    configured = {p.stem for p in (ROOT / "conf" / "system").glob("*.yaml")}
    assert not configured - set(SYSTEMS), "a system without a label in figures: add it to plots.records.SYSTEMS"
    assert set(SYSTEMS) == configured


def test_phase_breakdown_from_committed_records(tmp_path):
    out = tmp_path / "phases.png"
    n = phase_plot(RESULTS / "gpu_smoke_llama3" / "eager", out)
    assert n == 5 and out.stat().st_size > 10_000
    with pytest.raises(RecordError, match=r"records of 3 commits .*ab38f4e: graph/record_0.json"):
        phase_plot(RESULTS / "gpu_smoke_llama3", out)  # two folders of three commits
    assert phase_plot(RESULTS / "gpu_smoke_llama3", out, allow_mixed=True) == 9


def test_fig2_against_committed_records_and_the_paper(tmp_path):
    """The numbers results/fig2_breakdown_128k/README.md quotes, and the paper's totals drawn beside them."""
    rows = fig2_breakdown.plot(RESULTS / "fig2_breakdown_128k", tmp_path / "fig2")
    assert {p.suffix for p in tmp_path.iterdir()} == {".png", ".pdf"}
    assert rows["clo"]["percent_of_fullattn"] == pytest.approx(87.2, abs=0.05)
    assert rows["retroinfer"]["ms_per_step"] == pytest.approx(16.62, abs=0.01)
    assert rows["retroinfer"]["file"] == "record_retroinfer_untimed.json"
    assert rows["retroinfer"]["mgmt_percent"] == pytest.approx(17.5, abs=0.05)
    assert rows["pqcache"]["ms_per_step"] == pytest.approx(152.65, abs=0.01)


def overlapping(texts) -> list[tuple[str, str]]:
    """The pairs of drawn texts whose boxes overlap."""
    boxes = [(t.get_text(), t.get_window_extent()) for t in texts if t.get_text()]
    return [(a, c) for i, (a, b) in enumerate(boxes) for c, d in boxes[i + 1 :] if b.overlaps(d)]


def test_fig2_breaks_its_axis_below_the_tall_bars_and_says_phases_in_words(tmp_path, monkeypatch):
    """Baselines ten times FullAttn: the axis breaks between the short bars and the tall ones (each panel linear,
    so the stacks still add up), the legend names phases in words, and no bar's total runs into another's."""
    figs = drawn(fig2_breakdown, monkeypatch)
    rows = fig2_breakdown.plot(fig2_folder(tmp_path), tmp_path / "fig2")
    (fig,) = figs
    high, low = fig.axes
    tall = [r["percent_of_fullattn"] for n, r in rows.items() if n in ("retroinfer", "infinigen")]
    short = [rows[n]["percent_of_fullattn"] for n in ("fullattn", "clo")] + list(paper.FIG2_PERCENT_OF_IDEAL.values())
    assert max(short) < low.get_ylim()[1] < high.get_ylim()[0] < min(tall) and max(tall) < high.get_ylim()[1]
    legend = [t.get_text() for t in high.get_legend().get_texts()]
    assert "exposed transfer" in legend and "cache management" in legend and paper.FIG2 in legend
    assert not {"transfer_exposed", "cache_mgmt", "launch_sync"} & set(legend)
    fig.canvas.draw()
    assert not overlapping([t for ax in fig.axes for t in ax.texts])
    assert "(paper 27-36%)" in low.get_xticklabels()[2].get_text()  # RetroInfer-style's management beside the paper's


def test_fig2_keeps_one_axis_when_no_bar_towers(tmp_path):
    assert fig2_breakdown.axis_break([100.0, 87.0, 150.0]) is None
    low_top, high_bottom, high_top = fig2_breakdown.axis_break([100.0, 87.0, 137.0, 900.0, 1700.0])
    assert 137 < low_top < high_bottom < 900 and high_top > 1700


def test_fig2_steps_come_from_the_untimed_runs_split_as_the_timed_ones(tmp_path):
    """Phase timing slows a piecewise step: its bar is the untimed run's step, split as the timed run's phases."""
    folder = fig2_folder(tmp_path)  # retroinfer timed at 100 ms, its phases equal
    untimed = run_record("retroinfer", ms=80.0, phases_timed=False)
    untimed["metrics"]["phase_ms_per_step"] = {p: 0.0 for p in PHASES} | {"other": 80.0, "total": 80.0}
    write(folder, {"record_retroinfer_untimed.json": untimed})
    row = fig2_breakdown.data(folder)["systems"]["retroinfer"]
    assert row["ms_per_step"] == 80.0 and row["file"] == "record_retroinfer_untimed.json"
    assert row["split_file"] == "record_retroinfer.json" and row["split_ms_per_step"] == 100.0
    assert row["cache_mgmt"] == pytest.approx(80.0 / len(PHASES) / 32) and row["mgmt_percent"] == pytest.approx(
        100 / len(PHASES)
    )


def test_full_and_short_commits_are_one_commit(tmp_path):
    fig2_folder(tmp_path)
    rec = run_record("clo", "abc1234" + "0" * 33, 8.0)
    write(tmp_path, {"record_clo_b.json": rec})
    assert load_records(tmp_path).commit == "abc1234"


def test_bad_input_is_refused_naming_the_files(tmp_path, capsys, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NoRecords):
        fig2_breakdown.data(empty)
    monkeypatch.setattr(sys, "argv", ["fig2", str(empty), "--out", str(tmp_path / "x.png")])
    assert "no run records under" in refused(fig2_breakdown.main, capsys)
    assert not (tmp_path / "x.png").exists()

    mixed = fig2_folder(tmp_path / "mixed")
    write(mixed, {"record_clo.json": run_record("clo", "def5678", 9.0)})
    monkeypatch.setattr(sys, "argv", ["fig2", str(mixed), "--out", str(tmp_path / "x.png")])
    err = refused(fig2_breakdown.main, capsys)
    assert "records of 2 commits" in err and "def5678: record_clo.json" in err and "abc1234: record_fullattn" in err

    unknown = fig2_folder(tmp_path / "unknown")
    write(unknown, {"record_h2o.json": run_record("h2o")})
    with pytest.raises(RecordError, match=r"unknown system 'h2o' in record_h2o.json"):
        fig2_breakdown.data(unknown)

    lengths = fig2_folder(tmp_path / "lengths")
    write(lengths, {"record_clo.json": run_record("clo", seqlen=32768)})
    with pytest.raises(RecordError, match=r"several sequence lengths .*32768: record_clo.json"):
        fig2_breakdown.data(lengths)

    failed = write(tmp_path / "failed", {"record.json": run_record(status="failed")})
    with pytest.raises(RecordError, match="only others: record.json"):
        load_records(failed)


def test_link_record_drawn_and_checked(tmp_path):
    rows = [
        {"path": p, "threads": n, "tokens": t, "bytes": 1, "ms": 1.0, "gb_s": g, "of_bulk": 1.0}
        for t in (4096, 8192)
        for p, n, g in (("bulk", None, 50.0), ("uva", None, 45.0), ("cpu_gather", 1, 4.0), ("cpu_gather", 4, 9.0))
    ]
    rec = {"bench": "link_bandwidth", "device": "cuda", "rows": rows, "environment": {"git": {"commit": "abc1234"}}}
    fig3_13_link.plot(write(tmp_path / "link", {"record.json": rec}), tmp_path / "link.png")
    assert (tmp_path / "link.png").stat().st_size > 10_000
    rec["rows"] = [r for r in rows if r["path"] != "bulk"]
    write(tmp_path / "link", {"record.json": rec})
    with pytest.raises(RecordError, match="no bulk copy in record.json"):
        fig3_13_link.data(tmp_path / "link")


def test_all_draws_what_it_can_and_says_the_rest(tmp_path, capsys):
    results = tmp_path / "results"
    fig2_folder(results / "fig2_breakdown_128k")
    mixed = fig2_folder(results / "tab4_hit_rate")
    write(mixed, {"record_clo.json": run_record("clo", "def5678")})
    with pytest.raises(SystemExit) as e:
        plots_all.main(["--results", str(results), "--out", str(tmp_path / "figs")])
    assert e.value.code == 1
    out = capsys.readouterr().out
    assert f"ok: fig2_breakdown <- {results / 'fig2_breakdown_128k'} (commit abc1234)" in out
    assert f"failed: tab4_hit_rate ({results / 'tab4_hit_rate'}): records of 2 commits" in out
    assert f"no records yet: {results / 'fig10_throughput'}" in out
    drawn = sorted(p.name for p in (tmp_path / "figs").iterdir())
    assert drawn == ["fig2_breakdown.caption.md", "fig2_breakdown.pdf", "fig2_breakdown.png"]
    assert "no results folder" in refused(lambda: plots_all.main(["--results", str(tmp_path / "none")]), capsys)


def test_a_title_naming_a_commit_is_refused(tmp_path):
    """A figure names what it shows; the commits go in its caption. Numbers and hex-like words are not commits."""
    fig, ax = plt.subplots()
    ax.set_title("Fig. 2: llama3, 128K, 1048576 tokens, defaced")
    save(fig, tmp_path / "ok.png")
    fig, ax = plt.subplots()
    fig.suptitle("Fig. 2: llama3, 128K, commit 9612c61")
    with pytest.raises(ValueError, match="9612c61"):
        save(fig, tmp_path / "bad.png")
    assert not (tmp_path / "bad.png").exists()


def test_all_captions_each_figure_with_its_records_commits_and_titles_none(tmp_path, monkeypatch):
    """Every figure plots.all draws gets <name>.caption.md naming the commit of each record it drew (and the
    preflight's refusals apart, which ran at none); none of its titles or tick labels names a commit."""
    results = tmp_path / "results"
    fig2_folder(results / "fig2_breakdown_128k")
    fig10 = fig10_folder(results / "fig10_throughput")
    later = run_record("clo", "def5678", batch=2, **{"metrics.hit_rate_with_refreshes": 0.5})  # filled in later
    write(fig10, {"record_clo_later.json": later})
    texts, savefig = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (texts.extend(titles(fig)), savefig(fig, *a, **k)))
    status = plots_all.build(results, tmp_path / "figs", log=lambda line: None)
    drawn = {name for name, s in status.items() if s == "ok"}
    assert drawn == {"fig2_breakdown", "fig10_throughput", "tab4_hit_rate_batch"}
    assert texts and not [t for t in texts if "abc1234" in t or "def5678" in t]
    for name in drawn:
        assert "- commit abc1234, " in (tmp_path / "figs" / f"{name}.caption.md").read_text(), name
    text = (tmp_path / "figs" / "fig10_throughput.caption.md").read_text()
    assert "- commit def5678, 1 file(s): `record_clo_later.json`" in text
    assert f"- {plots_all.REFUSED}, 3 file(s): `clo_64/record.json`," in text


def test_committed_figures_have_their_current_captions():
    """Each committed figure has the caption its committed records give (python -m plots.all writes both)."""
    figures = RESULTS / "figures"
    for f in plots_all.FIGURES:
        png, cap = figures / f"{f.name}.png", figures / f"{f.name}.caption.md"
        assert png.exists() == cap.exists(), f"{f.name}: a figure without its caption or the other way round"
        if png.exists():
            assert cap.read_text() == plots_all.caption(f, RESULTS), f"{cap} is stale: python -m plots.all"


def test_a_graph_steps_bar_is_split_as_its_traced_kernels(tmp_path):
    """CLO's graph step has no events of its own: experiments.runner.trace_phases' split of its traced step divides
    it."""
    folder = fig2_folder(tmp_path)
    clo = json.loads((folder / "record_clo.json").read_text())
    clo["phases_timed"] = False
    clo["metrics"]["phase_ms_per_step"] = {p: 0.0 for p in clo["metrics"]["phase_ms_per_step"]} | {"other": 9.0}
    clo["trace_phase_ms"] = {"retrieval": 1.0, "attention": 2.0, "other": 7.0}
    (folder / "record_clo.json").write_text(json.dumps(clo))
    row = fig2_breakdown.data(folder)["systems"]["clo"]
    layers = clo["config"]["model"]["num_layers"]
    assert row["phases_from_trace"] and row["retrieval"] * layers == pytest.approx(0.9)
    assert row["attention"] * layers == pytest.approx(1.8) and row["other"] * layers == pytest.approx(6.3)
