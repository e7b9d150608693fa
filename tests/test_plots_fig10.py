"""Figure 10 (decode and prefill throughput) from records: the committed READMEs quote the tables and speedup
ranges their records give, and over fake records the throughput, the refusals (device budget, host RAM), Table 4
by batch, mixed budgets, link caps or KV dtypes refused, and each panel's ticks, ratio row and refusal legend."""

import pytest

from plots import (
    fig10_prefill,
    fig10_throughput,
    tab4_hit_rate_batch,
)
from plots.records import RecordError
from tests.plot_helpers import RESULTS, drawn, fig10_folder, run_record, write


@pytest.mark.parametrize(
    ("folder", "min_rows", "points", "span", "median_span"),
    [
        ("fig10_throughput", 40, 16, "1.51-2.41x", "1.49-2.36x"),
        ("fig10_beyond", 10, 6, "0.33-2.53x", "0.33-2.52x"),
        ("fig10_throughput_nobudget", 45, 19, "1.42-3.06x", "1.40-3.05x"),
        ("fig10_throughput_qwen25", 3, 5, "1.19-1.83x", "1.13-1.82x"),
    ],
)
def test_the_committed_figure_10_readmes_quote_their_records(folder, min_rows, points, span, median_span):
    """A Figure 10 folder's README.md holds the tables its records give (plots.fig10_throughput.table), and the
    ranges of CLO / best baseline over the points where both ran, by throughput and by median step, are theirs."""
    table = fig10_throughput.table(RESULTS / folder, folder)
    readme = (RESULTS / folder / "README.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) > min_rows and all(row in readme for row in rows), [r for r in rows if r not in readme][:3]
    d = fig10_throughput.data(RESULTS / folder, allow_mixed=True)
    for ratios, want in ((d["speedup"].values(), span), (d["speedup_median"].values(), median_span)):
        assert len(ratios) == points and f"{min(ratios):.2f}-{max(ratios):.2f}x" == want


def test_the_committed_prefill_readme_quotes_its_records(tmp_path):
    """results/fig10_prefill/README.md holds the table its records give: CLO within 0.8x of FullAttn's prefill
    tokens/s wherever FullAttn ran in the same sweep (the issue's target), and FullAttn's refusal at 128K BSZ 4;
    plots.fig10_prefill draws the same folder."""
    table = fig10_prefill.table(RESULTS / "fig10_prefill", "fig10_prefill")
    readme = (RESULTS / "fig10_prefill" / "README.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 18 and all(row in readme for row in rows), [r for r in rows if r not in readme][:3]
    clo = [row.split(" | ")[5] for row in rows if " | CLO | " in row]
    assert [float(x) >= 0.8 for x in clo if x != "-"] == [True] * 3
    assert "| 128K | 4 | FullAttn | OOM |" in table
    d = fig10_prefill.plot(RESULTS / "fig10_prefill", tmp_path / "prefill", allow_mixed=True)
    assert (tmp_path / "prefill.png").exists() and len(d["points"]) == 17


def test_throughput_from_run_records(tmp_path):
    d = fig10_throughput.plot(fig10_folder(tmp_path), tmp_path / "fig10.png")
    assert d["speedup"] == {(131072, 1): pytest.approx(1.2), (131072, 4): pytest.approx(1.2)}
    assert d["speedup_median"] == {(131072, 1): pytest.approx(1.25)}  # BSZ 4's records have no steps
    assert d["refused"] == [("clo", 131072, 64, "RAM"), ("fullattn", 131072, 16, "OOM"), ("fullattn", 786432, 1, "OOM")]
    assert d["panels"] == [131072, 786432]
    table = fig10_throughput.table(tmp_path, "fig10")  # each system against its own floor, at the run plotted
    assert "| 128K b1 | 6.67 | 8.33 / 4.00 = 2.08x (100 MB, hit 0.800 / 0.500) | 10.00 / 4.00 = 2.50x" in table
    assert "12.50 / 4.00 = 3.12x (100 MB) | 1.00x |" in table
    assert "No device budget. " in table
    assert "| 128K | 1 | 150.0 | 120.0 | 100.0 | 80.0 | 1.20x | 1.25x | abc1234 |" in table
    assert "| 128K | 4 | 600.0 | 480.0 | 400.0 | 320.0 | 1.20x | - | abc1234 |" in table
    hits = tab4_hit_rate_batch.plot(tmp_path, tmp_path / "tab4_batch.png")  # Table 4 by batch from the same runs
    assert [(r["batch"], r["clo"]["hit_rate_with_refreshes"], r["plan"]["prefetch"]) for r in hits["rows"]] == [
        (1, 0.5, 1),
        (4, 0.5, 1),
    ]
    assert len(hits["records"]) == 4  # CLO's and RetroInfer-style's runs, not the others'
    assert "| 128K | 4 | 3/1/- | 80.0% | 50.0% | 100.0 | 80.0% | 100.0 | - |" in tab4_hit_rate_batch.table(
        tmp_path, "fig10"
    )
    budgeted = run_record("clo", batch=8, **{"config.hardware": {"gpu_mem_gb": 48}})  # the paper's grid beside it
    write(tmp_path / "clo_8", {"record.json": budgeted})
    with pytest.raises(RecordError, match=r"several device budgets .*\(none, 48 GB; hardware.gpu_mem_gb\)"):
        fig10_throughput.data(tmp_path)
    capped = run_record("clo", batch=8, **{"config.hardware": {"link_gb_s": 21.21}})  # a slower link beside it
    write(tmp_path / "clo_8", {"record.json": capped})
    with pytest.raises(RecordError, match=r"several link caps .*\(none, 21.21 GB/s; hardware.link_gb_s\)"):
        fig10_throughput.data(tmp_path)
    fp8 = run_record("clo", batch=8, **{"config.kv_dtype": "fp8"})  # FP8 host rows beside the model's dtype
    write(tmp_path / "clo_8", {"record.json": fp8})
    with pytest.raises(RecordError, match=r"several host KV dtypes .*\(fp8, model; kv_dtype\)"):
        fig10_throughput.data(tmp_path)


def test_fig10_panels_tick_their_batches_and_say_whose_refusal(tmp_path, monkeypatch):
    """Each panel ticks the batches run or refused at its length (768K's one batch, not a span around it); the
    ratio row says what it is; a refusal's marker takes its system's colour, and the legend shows each kind of
    refusal in the colours of the systems refused so and says the convention."""
    figs = drawn(fig10_throughput, monkeypatch)
    fig10_throughput.plot(fig10_folder(tmp_path), tmp_path / "fig10")
    (fig,) = figs
    (t128, t768), (r128, r768) = fig.axes[:2], fig.axes[2:4]
    assert [t.get_text() for t in r128.get_xticklabels()] == ["1", "4", "16", "64"]  # runs at 1, 4; refusals
    assert list(t768.get_xticks()) == [1] and 0.5 < t768.get_xlim()[0] < 1 < t768.get_xlim()[1] < 2
    assert r128.get_ylabel() == fig10_throughput.RATIO_LABEL and r128.get_shared_y_axes().joined(r128, r768)
    marks = {
        (line.get_marker(), line.get_color()) for ax in (t128, t768) for line in ax.lines if line.get_marker() in "x+"
    }
    colour = fig10_throughput.colour
    assert marks == {("x", colour("fullattn")), ("+", colour("clo"))}
    (legend,) = fig.legends
    texts = [t.get_text() for t in legend.get_texts()]
    assert set(fig10_throughput.REFUSED_LABELS.values()) <= set(texts) and "colour" in legend.get_title().get_text()
