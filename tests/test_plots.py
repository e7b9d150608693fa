"""Figures are made from records: each plot over the committed records (its numbers checked against the README
that quotes them) or over small fake records of its producer's format, and every bad input (no records, mixed
commits, an unknown system) refused with one line that names the files, exit status 2."""

import json
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
from matplotlib.figure import Figure

from kvoffload.kv.timer import PHASES
from plots import (
    ablation,
    fig2_breakdown,
    fig3_13_link,
    fig10_prefill,
    fig10_throughput,
    paper,
    tab4_hit_rate,
    tab4_hit_rate_batch,
    tab5_ablation,
    tab5_accuracy,
    tab6_memory,
)
from plots import all as plots_all
from plots.phase_breakdown import plot as phase_plot
from plots.records import SYSTEMS, NoRecords, RecordError, cli, load_records, save, titles

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"


def run_record(system="clo", commit="abc1234", ms=10.0, **extra) -> dict:
    """A finished run record with the fields the plots read (experiments/runner/records.py writes many more)."""
    phases = {p: ms / len(PHASES) for p in PHASES} | {"total": ms}
    rec = {
        "status": "ok",
        "system": system,
        "model": "llama3",
        "seqlen": 131072,
        "batch": 1,
        "decode_mode": "piecewise",
        "phases_timed": True,
        "config": {
            "seqlen": "128k",
            "model": {"num_layers": 32},
            "system": {"adaptive_threshold": True, "gqa_aggregation": "mean", "persistent": True},
            "workload": {"needle_depth": 0.5},
        },
        "metrics": {
            "decode_ms_per_step": ms,
            "phase_ms_per_step": phases,
            "hit_rate": 0.8 if system in ("clo", "retroinfer") else None,
            "bytes_h2d_per_step": 1e8,
            "dense_floor_ms_per_step": 5.0,
            "decode_tokens_per_s": 1000 / ms,
            "prefill_tokens_per_s": 5000.0,
        },
        "system_state": {"plan": {"persistent_heads": 3, "prefetch_heads": 1}},
        "environment": {"device": "cuda", "git": {"commit": commit, "dirty": False}},
    }
    for key, value in extra.items():  # "config.system.persistent": False sets a nested field
        *path, last = key.split(".")
        node = rec
        for p in path:
            node = node[p]
        node[last] = value
    return rec


def write(folder: Path, records: dict[str, dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, rec in records.items():
        (folder / name).write_text(json.dumps(rec))
    return folder


def fig2_folder(folder: Path, commit="abc1234") -> Path:
    return write(
        folder,
        {
            f"record_{s}.json": run_record(s, commit, ms)
            for s, ms in (("fullattn", 10.0), ("clo", 9.0), ("retroinfer", 100.0), ("infinigen", 130.0))
        },
    )


def refused(fn, capsys) -> str:
    """fn run as a command: exit status 2 and one `error:` line on stderr, returned."""
    with pytest.raises(SystemExit) as e:
        cli(fn)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


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


def drawn(module, monkeypatch) -> list:
    """The figures `module` draws, kept open instead of saved (to read their axes, legends and labels)."""
    figs = []
    monkeypatch.setattr(module, "save", lambda fig, out: figs.append(fig))
    return figs


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


def test_ablation_variants_from_switches(tmp_path):
    variants = {
        "base": (False, "min", False, 20.0),
        "t": (True, "min", False, 13.0),
        "tg": (True, "mean", False, 12.0),
        "tgp": (True, "mean", True, 10.0),
    }
    folder = write(
        tmp_path / "abl",
        {
            f"record_{v}.json": run_record(
                "clo",
                ms=ms,
                **{"config.system.adaptive_threshold": t, "config.system.gqa_aggregation": g},
                **{"config.system.persistent": p},
            )
            for v, (t, g, p, ms) in variants.items()
        },
    )
    rows = ablation.plot(folder, tmp_path / "abl.png")
    assert [round(r["vs_base_percent"], 1) for r in rows.values()] == [0.0, -35.0, -40.0, -50.0]
    write(folder, {"record_dup.json": run_record("clo", ms=11.0)})
    with pytest.raises(RecordError, match="two records of variant tgp"):
        ablation.data(folder)


def test_committed_hit_rates_and_memory(tmp_path):
    """results/tab4_hit_rate/README.md: CLO 81.2 / 82.6%, RetroInfer-style 91.9 / 93.0%; tab6 (32K-512K): 57, 81,
    101, 125 and 125 % of the device KV state, 36, 72, 102, 137 and 136 % of the cache."""
    rows = tab4_hit_rate.plot(RESULTS / "tab4_hit_rate", tmp_path / "tab4.png")
    assert [round(r["hit_rate"] * 100, 1) for r in rows] == [81.2, 82.6, 91.9, 93.0]
    tab6 = tab6_memory.plot(RESULTS / "tab6_memory", tmp_path / "tab6.png")
    assert [round(r) for r in tab6["ratio"].values()] == [57, 81, 101, 125, 125]
    assert [round(r) for r in tab6["cache_ratio"].values()] == [36, 72, 102, 137, 136]
    gpu = ablation.data(RESULTS / "ablation_gpu_128k")["variants"]
    assert [round(r["vs_base_percent"], 1) for r in gpu.values()] == [0.0, -36.1, -38.1, -50.9]


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


def fig10_folder(folder: Path) -> Path:
    """Figure 10's runs at 128K, BSZ 1 and 4, of four systems; refusals for the device budget and the host's RAM,
    and a length (768K) where every run was refused."""
    recs = {}
    for s, tps in (("clo", 120.0), ("retroinfer", 100.0), ("infinigen", 80.0), ("fullattn", 150.0)):
        for b in (1, 4):
            rec = run_record(s, batch=b)
            rec["metrics"]["decode_tokens_per_s"] = tps * b
            rec["metrics"]["decode_ms_per_step"] = 1000 * b / rec["metrics"]["decode_tokens_per_s"]
            if s != "fullattn":
                rec["metrics"] |= {"system_floor_ms_per_step": 4.0, "hit_rate_with_refreshes": 0.5, "kv_device_gb": 2.0}
            if b == 1:  # four steps measured after one that is not; RetroInfer-style's slow step moves only its mean
                totals = {"clo": [99, 8, 8, 8, 8], "retroinfer": [99, 10, 10, 10, 40]}.get(s, [99, 12, 12, 12, 12])
                rec["metrics"]["decode_steps_measured"] = 4
                rec["steps"] = [{"phase_ms": {"total": float(t)}} for t in totals]
            recs[f"{s}_{b}/record.json"] = rec
    recs["fullattn_16/record.json"] = {  # the preflight's refusal, as experiments.run records it
        "status": "failed",
        "error_kind": "config",
        "error": "system=fullattn model=llama3 seqlen=128k batch=16 needs about 300.0 GB of GPU memory",
        "overrides": ["system=fullattn", "seqlen=128k", "batch=16", "+experiment=fig10_throughput"],
    }
    recs["clo_64/record.json"] = {  # refused for the host's RAM, not the device budget
        "status": "failed",
        "error_kind": "config",
        "error": "system=clo model=llama3 seqlen=128k batch=64 needs about 1100.0 GB of RAM on this host (weights 15)",
        "overrides": ["system=clo", "seqlen=128k", "batch=64", "+experiment=fig10_throughput"],
    }
    recs["fullattn_768k/record.json"] = {  # a length where every run was refused still gets its panel
        "status": "failed",
        "error_kind": "config",
        "error": "system=fullattn model=llama3 seqlen=768k batch=1 needs about 124.4 GB of GPU memory",
        "overrides": ["system=fullattn", "seqlen=768k", "batch=1", "+experiment=fig10_throughput"],
    }
    for name in recs:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
    return write(folder, recs)


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


def test_accuracy_records_against_table_5(tmp_path):
    env = {"git": {"commit": "abc1234"}}
    scores = {"longbench": 41.0, "ruler_16k": 85.0}
    recs = {
        f"record_{s}.json": {
            "experiment": "accuracy",
            "system": s,
            "model": "llama3",
            "scores": scores,
            "environment": env,
        }
        for s in ("fullattn", "clo")
    }
    d = tab5_accuracy.plot(write(tmp_path / "acc", recs), tmp_path / "tab5.png")
    assert d["tasks"] == ["longbench", "ruler_16k"] and d["scores"][("llama3", "clo")] == scores
    other = {
        "experiment": "accuracy",
        "system": "clo",
        "model": "qwen25",
        "scores": {"niah@4k": 0.9},
        "environment": env,
    }
    write(tmp_path / "acc", {"record_other.json": other})
    assert tab5_accuracy.plot(tmp_path / "acc", tmp_path / "tab5.png")["tasks"] == ["longbench", "ruler_16k", "niah@4k"]
    bad = {**other, "scores": {"niah@4k": "high"}}
    write(tmp_path / "acc", {"record_bad.json": bad})
    with pytest.raises(RecordError, match="scores of niah@4k in record_bad.json are not numbers"):
        tab5_accuracy.data(tmp_path / "acc")


def ablation_record(variant: str, task: str, score: float, hit: float, system: str = "clo") -> dict:
    return {
        "status": "ok",
        "system": system,
        "model": "smollm2",
        "overrides": ["workload.lengths=2k", f"workload.tasks={task}", f"+clo_ablation={variant}"],
        "tasks": {task: {"2048": {"score": score, "samples": [{"doc_id": 0, "score": score}]}}},
        "cost_per_sample": {"hit_rate": hit},
        "environment": {"git": {"commit": "abc1234"}},
    }


def test_table_5_ablation_averages_only_the_cells_every_variant_scored(tmp_path):
    recs = {
        "record_simhash_vt.json": ablation_record("simhash", "ruler_vt", 0.2, 0.7),
        "record_simhash_niah.json": ablation_record("simhash", "niah", 1.0, 0.8),
        "record_exact_vt.json": ablation_record("exact", "ruler_vt", 0.4, 0.9),  # exact has not run niah yet
    }
    d = tab5_ablation.plot(write(tmp_path / "abl", recs), tmp_path / "abl.png")
    assert d["cells"] == ["ruler_vt@2048"] and d["means"] == {"simhash": 0.2, "exact": 0.4}
    assert d["hit_rate"] == {"simhash": 0.7, "exact": 0.9} and d["missing"]["exact"] == ["niah@2048"]
    write(tmp_path / "abl", {"record_x.json": ablation_record("eta0.5", "ruler_vt", 0.1, 0.5)})
    with pytest.raises(RecordError, match="not a CLO record of a known"):
        tab5_ablation.data(tmp_path / "abl")
    (tmp_path / "abl" / "record_x.json").unlink()
    write(tmp_path / "abl", {"record_y.json": ablation_record("exact", "ruler_vt", 0.5, 0.9)})
    with pytest.raises(RecordError, match="exact scores ruler_vt@2048 twice"):
        tab5_ablation.data(tmp_path / "abl")


def test_table_5_ablation_cells_may_differ_in_commit_but_not_their_variants(tmp_path):
    recs = {f"record_{v}_vt.json": ablation_record(v, "ruler_vt", 0.2, 0.7) for v in ("simhash", "exact")}
    for v in ("simhash", "exact"):  # another cell, run later at another commit
        recs[f"record_{v}_niah.json"] = ablation_record(v, "niah", 1.0, 0.8)
        recs[f"record_{v}_niah.json"]["environment"]["git"]["commit"] = "def5678"
    d = tab5_ablation.data(write(tmp_path / "abl", recs))
    assert d["commits"] == {"niah@2048": "def5678", "ruler_vt@2048": "abc1234"}
    recs["record_exact_vt.json"]["environment"]["git"]["commit"] = "fff0000"  # one variant of a cell elsewhere
    with pytest.raises(RecordError, match="variants of ruler_vt@2048 ran at different commits.*fff0000"):
        tab5_ablation.data(write(tmp_path / "abl", recs))


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


def test_table5_merges_the_accuracy_commands_cells(tmp_path):
    """experiments.accuracy's records (a sweep writes one per task and length) become one row per system, a task at
    a length named <task>@<tokens>; a cell scored by two records is refused."""

    def cell(system, task, length, score):
        return {
            "status": "ok",
            "system": system,
            "model": "smollm2",
            "tasks": {task: {str(length): {"score": score, "n": 20}}},
            "environment": {"git": {"commit": "abc1234"}},
        }

    recs = {
        f"{s}-{t}/record.json": cell(s, t, 4096, sc)
        for s, t, sc in (("fullattn", "ruler_vt", 0.4), ("fullattn", "niah_single_1", 1.0), ("clo", "ruler_vt", 0.3))
    }
    for name in recs:
        (tmp_path / "acc" / name).parent.mkdir(parents=True, exist_ok=True)
    d = tab5_accuracy.data(write(tmp_path / "acc", recs))
    assert d["scores"][("smollm2", "fullattn")] == {"ruler_vt@4096": 0.4, "niah_single_1@4096": 1.0}
    assert d["scores"][("smollm2", "clo")] == {"ruler_vt@4096": 0.3}
    (tmp_path / "acc" / "again").mkdir()
    write(tmp_path / "acc", {"again/record.json": cell("clo", "ruler_vt", 4096, 0.35)})
    with pytest.raises(RecordError, match="two accuracy records of clo on smollm2 score ruler_vt@4096"):
        tab5_accuracy.data(tmp_path / "acc")


def test_tab5_cells_may_differ_in_commit_but_not_their_systems(tmp_path):
    """A table filled in over sessions: each cell at its own commit is drawn and named; a cell whose systems ran
    at different commits (their comparison) is refused, naming the files."""

    def cell(system, task, commit):
        return {
            "status": "ok",
            "system": system,
            "model": "smollm2",
            "tasks": {task: {"2048": {"score": 0.5, "n": 20}}},
            "environment": {"git": {"commit": commit}},
        }

    recs = {
        f"record_{s}_{t}.json": cell(s, t, c)
        for s, t, c in (("fullattn", "a", "aaa1111"), ("clo", "a", "aaa1111"), ("fullattn", "b", "bbb2222"))
    }
    d = tab5_accuracy.data(write(tmp_path / "acc", recs))
    assert d["commits"] == {("smollm2", "a@2048"): "aaa1111", ("smollm2", "b@2048"): "bbb2222"}
    write(tmp_path / "acc", {"record_clo_b.json": cell("clo", "b", "ccc3333")})
    with pytest.raises(RecordError, match="b@2048 on smollm2 ran at different commits.*ccc3333.*bbb2222"):
        tab5_accuracy.data(tmp_path / "acc")


def test_table_5_ablation_readme_without_and_with_the_table(tmp_path):
    from plots.tab5_readme import ablation_blocks

    def ablation_readme(folder, table):
        return "\n".join(ablation_blocks(folder, table).values())

    recs = {
        "record_a.json": ablation_record("simhash", "ruler_vt", 0.2, 0.7),
        "record_b.json": ablation_record("exact", "ruler_vt", 0.4, 0.9),
        "record_c.json": ablation_record("exact", "niah", 1.0, 0.9),
    }
    folder = write(tmp_path / "abl", recs)
    text = ablation_readme(folder, tmp_path / "no_table")
    assert "| `simhash` | 0.200 | 0.700 |" in text and "simhash: `niah` @ 2K" in text
    full = ablation_record("exact", "ruler_vt", 0.5, 0.0, system="fullattn")
    table = write(tmp_path / "tab", {"record_f.json": {**full, "overrides": []}})
    assert "| `exact` | 0.400 | 0.900 | 10.0 | 10.0 to 10.0 |" in ablation_readme(folder, table)  # one sample
