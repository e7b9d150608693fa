"""The tables from records: Table 4's hit rates and Table 6's memory over the committed records, the GPU
ablation's variants, and Table 5 (accuracy, and CLO's ablation): cells merged from the accuracy command's records,
cells that may differ in commit but not their systems or variants, and the ablation's README blocks."""

import pytest

from plots import (
    ablation,
    tab4_hit_rate,
    tab5_ablation,
    tab5_accuracy,
    tab6_memory,
)
from plots.records import RecordError
from tests.plot_helpers import RESULTS, run_record, write


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
