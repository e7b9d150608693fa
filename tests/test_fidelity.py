"""The fidelity workload (experiments.fidelity) on the real SmolLM2 weights: FullAttn through the decode steps is the
dense reference; a batch of documents gives each what it gets alone; the statistics; the documents' selection; bad
input refused before any work."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from experiments.accuracy.config import compose_config
from experiments.fidelity import documents as docs
from experiments.fidelity.measure import reference, step_metrics, teacher_forced
from kvoffload.errors import ConfigError
from plots.bootstrap import interval, paired

LENGTH, STEPS = 320, 12
SYSTEMS = ["fullattn", "clo", "retroinfer", "infinigen", "pqcache", "clo +clo_ablation=oracle"]


@pytest.fixture(scope="module")
def backbone():
    from experiments.accuracy.backbone import backbone_for

    cfg, _ = compose_config(["workload=fidelity", "system=fullattn", "dtype=float32", "device=cpu"])
    return backbone_for(cfg)


@pytest.fixture(scope="module")
def texts(backbone):
    """Two documents of real prose: this repository's own docstrings (no package needed)."""
    import experiments.accuracy.backbone as a
    import experiments.fidelity.measure as m

    out = []
    for i, module in enumerate((a, m)):
        ids = backbone.tokenizer.encode((module.__doc__ or "") * 8)[:LENGTH]
        assert len(ids) == LENGTH
        out.append(docs.Document(f"doc{i}", tuple(ids), ""))
    return out


def run(backbone, name, group, refs, probe=True):
    # a short window, so that the short documents leave the sparse systems a middle to select from
    window = [] if name == "fullattn" else ["system.sink=4", "system.recent=8"]
    overrides = ["workload=fidelity", "dtype=float32", "device=cpu", *f"system={name}".split(" "), *window]
    cfg, system_name = compose_config(overrides)
    prefix = LENGTH - STEPS - 1
    layer_s = backbone.layer_time_s * len(group)
    system = backbone.system(cfg.system, system_name, prefix, STEPS, len(group), layer_s)
    return teacher_forced(backbone, system, group, refs, (4, 8) if window and probe else None)


@pytest.mark.slow
def test_fullattn_through_decode_steps_is_the_dense_reference(backbone, texts):
    refs = [reference(backbone, d, STEPS) for d in texts]
    per_doc, cost = run(backbone, "fullattn", texts, refs)
    for d in per_doc:
        assert d["kl"] < 1e-5 and d["top1"] == 1.0
        assert abs(d["ll"] - d["ll_ref"]) < 1e-4
    assert cost["bytes_h2d_per_step"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("name", SYSTEMS)
def test_a_batch_of_documents_gives_each_what_it_gets_alone(backbone, texts, name):
    refs = [reference(backbone, d, STEPS) for d in texts]
    together, _ = run(backbone, name, texts, refs)
    alone = [run(backbone, name, [d], [r])[0][0] for d, r in zip(texts, refs)]
    for t, a in zip(together, alone):
        assert t["doc"] == a["doc"]
        assert t["top1"] == a["top1"]
        assert t["kl"] == pytest.approx(a["kl"], rel=1e-3, abs=1e-6)


@pytest.mark.slow
def test_a_sparse_system_departs_from_the_reference(backbone, texts):
    """The measure moves: at top-k 5 % of a short prompt, the exact top-k oracle is measurably off exact attention."""
    refs = [reference(backbone, d, STEPS) for d in texts]
    oracle = "clo +clo_ablation=oracle system.topk_ratio=0.05"  # 4 of 295 middle tokens
    per_doc, _ = run(backbone, oracle, texts, refs)
    assert all(d["kl"] > 1e-3 for d in per_doc)


@pytest.mark.slow
def test_what_the_sparse_layers_attended(backbone, texts):
    """The oracle attends the exact top-k of the real query (recall 1) and misses some of exact attention's weight;
    a system that reuses or hashes recalls less; the measure leaves the fidelity itself unchanged."""
    refs = [reference(backbone, d, STEPS) for d in texts]
    oracle, cost = run(backbone, "clo +clo_ablation=oracle system.topk_ratio=0.05", texts, refs)
    assert all(d["recall"] == pytest.approx(1.0) and 0.0 < d["mass"] < 1.0 for d in oracle)
    assert set(cost["per_layer"]) == {str(i) for i in range(2, 30)}  # CLO's two dense layers attend everything
    for name in ("clo", "retroinfer", "infinigen", "pqcache"):
        probed, _ = run(backbone, name, texts, refs)
        assert all(0.0 <= d["recall"] <= 1.0 and 0.0 < d["mass"] <= 1.0 for d in probed), name
    assert min(d["recall"] for d in probed) < 1.0
    plain, _ = run(backbone, "pqcache", texts, refs, probe=False)
    assert [d["kl"] for d in plain] == [d["kl"] for d in probed] and "recall" not in plain[0]
    full, _ = run(backbone, "fullattn", texts, refs)
    assert "recall" not in full[0]


def test_step_metrics_by_hand():
    ref = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0]]), -1)
    same = step_metrics(ref, ref, torch.tensor([0]))[0]
    assert same[0].item() == pytest.approx(0.0, abs=1e-7) and same[1].item() == 1.0
    other = torch.log_softmax(torch.tensor([[0.0, 1.0, 2.0]]), -1)
    m = step_metrics(other, ref, torch.tensor([0]))[0]
    p = ref.exp()[0]
    assert m[0].item() == pytest.approx(float((p * (ref[0] - other[0])).sum()))
    assert m[1].item() == 0.0 and m[2].item() == pytest.approx(other[0, 0].item())
    assert m[3].item() == pytest.approx(ref[0, 0].item())


def test_a_system_refused_for_memory_gets_the_reference_caches():
    """An 8K sweep was refused on its third batch while the reference cache held the first two batches' documents:
    the cache gives its memory up before the run stops; with nothing cached the refusal stands."""
    from experiments.accuracy.backbone import Prefill, PrefillCache
    from experiments.fidelity.__main__ import planned

    class Backbone:  # refuses while the cache holds anything, as a host short by the cache's size would
        def system(self, *args):
            if cache.used:
                raise ConfigError("host RAM short")
            return args

    cache = PrefillCache(max_bytes=1 << 20)
    cache.put((1, 2), Prefill(torch.zeros(1), [torch.zeros(4)], [torch.zeros(4)], 0.0))
    assert cache.used and planned(Backbone(), cache, "clo", 7) == ("clo", 7)
    assert cache.used == 0 and not cache.entries
    with pytest.raises(ConfigError, match="host RAM short"):
        cache.used = 1  # short for another reason than the cache: refused
        planned(Backbone(), cache, "clo", 7)


def test_interval_covers_the_mean_and_shrinks_with_documents():
    rng = np.random.default_rng(1)
    few, many = rng.normal(1.0, 1.0, 10), rng.normal(1.0, 1.0, 400)
    m, lo, hi = interval(few)
    assert lo < m < hi
    m2, lo2, hi2 = interval(many)
    assert hi2 - lo2 < (hi - lo) / 3
    assert interval([2.0, 2.0, 2.0]) == (2.0, 2.0, 2.0)


def test_paired_interval_uses_the_shared_documents_only():
    a = {"x": 1.0, "y": 2.0, "z": 9.0}
    b = {"x": 0.5, "y": 1.5}
    assert paired(a, b)[0] == pytest.approx(0.5)
    assert paired(a, {"w": 1.0}) is None


def test_selection_is_seeded_and_extends(tmp_path):
    class Chars:  # one token per character
        def encode(self, text):
            return [ord(c) for c in text]

    for i in range(6):
        (tmp_path / "howto").mkdir(exist_ok=True)
        (tmp_path / "howto" / f"f{i}.rst.txt").write_text(f"{i}" * (50 + i))
    (tmp_path / "c-api").mkdir()
    (tmp_path / "c-api" / "long.rst.txt").write_text("x" * 500)  # not prose: never chosen
    (tmp_path / "howto" / "short.rst.txt").write_text("s" * 10)  # too short
    three = docs.select(tmp_path, Chars(), 3, 50, 40, seed=0)
    five = docs.select(tmp_path, Chars(), 5, 50, 40, seed=0)
    assert [d.name for d in five[:3]] == [d.name for d in three]
    assert all(len(d.ids) == 40 and d.name.startswith("howto/f") for d in five)
    assert [d.name for d in docs.select(tmp_path, Chars(), 5, 50, 40, seed=1)] != [d.name for d in five]
    with pytest.raises(ConfigError, match="has 6 prose files"):
        docs.select(tmp_path, Chars(), 7, 50, 40, seed=0)


def test_unknown_source_and_missing_folder_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="valid: python-docs"):
        docs.sources_dir("gutenberg", None)
    with pytest.raises(ConfigError, match="no such folder"):
        docs.sources_dir("python-docs", str(tmp_path / "absent"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "override, message",
    [
        ("workload.source=gutenberg", "workload.source='gutenberg'"),
        ("workload.length=16k", "exceed model=smollm2's context of 8192"),
        ("workload.steps=2047", "workload.steps=2047 must be below"),
        ("system.topk_ratio=1.5", "topk_ratio=1.5"),
    ],
)
def test_bad_input_is_one_error_line_before_any_work(tmp_path, override, message):
    system = [] if override.startswith("system.") else ["system=fullattn"]
    cmd = [sys.executable, "-m", "experiments.fidelity", *system, override, f"results_dir={tmp_path}"]
    if override.startswith("system."):
        cmd.insert(3, "system=clo")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("error:") and message in lines[-1], lines[-3:]
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_the_command_end_to_end_on_the_python_documentation(tmp_path):
    """Two documents of the real source through FullAttn and CLO: a record each, FullAttn at the reference."""
    try:
        docs.sources_dir("python-docs", None)
    except ConfigError as e:
        pytest.skip(str(e))
    cmd = [
        sys.executable, "-m", "experiments.fidelity", "--multirun", "system=fullattn,clo", "workload.length=512",
        "workload.steps=8", "workload.documents=2", "workload.batch=2", f"results_dir={tmp_path}",
    ]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    from plots.fidelity import blocks, by_length, load

    records = by_length(load(tmp_path))[512]
    assert [r["label"] for r in records] == ["fullattn", "clo"]
    full, clo = records
    assert full["summary"]["kl"]["mean"] < 1e-5 and clo["summary"]["kl"]["mean"] > full["summary"]["kl"]["mean"]
    assert [d["name"] for d in full["documents"]] == [d["name"] for d in clo["documents"]]
    assert all(len(d["sha256"]) == 64 for d in full["documents"])
    assert clo["plan_inputs"]["pinned"] == {"link_gb_s": True, "layer_time_ms": True}
    assert "| clo | 2 |" in blocks(tmp_path)["tables"]


def _fidelity_record(system: str, ratio: float, top1: float, **settings) -> dict:
    summary = {m: {"mean": v, "low": v - 0.01, "high": v + 0.01} for m, v in (("kl", 0.1), ("top1", top1), ("dll", 0))}
    return {
        "status": "ok",
        "system": system,
        "label": f"{system} system.topk_ratio={ratio}",
        "model": "smollm2",
        "workload": {"length": 2048},
        "per_document": [{"doc": "a", "kl": 0.1, "top1": top1}],
        "summary": summary,
        "config": {"system": {"topk_ratio": ratio, "sink": 16, **settings}},
        "environment": {"git": {"commit": "abcdef0"}},
    }


def _gpu_record(system: str, ratio: float, tps: float, **settings) -> dict:
    return {
        "status": "ok",
        "system": system,
        "model": "llama3",
        "seqlen": 131072,
        "batch": 1,
        "metrics": {"decode_tokens_per_s": tps},
        "config": {"seqlen": "128k", "system": {"topk_ratio": ratio, "sink": 16, "transfer": "uva", **settings}},
        "environment": {"git": {"commit": "1234567"}},
    }


def _write(folder, name, rec):
    import json

    (folder / name).mkdir(parents=True)
    (folder / name / "record.json").write_text(json.dumps(rec))


def test_the_frontier_pairs_a_systems_records_of_one_setting_and_refuses_two(tmp_path):
    from plots import fidelity_frontier
    from plots.records import RecordError

    cpu, gpu = tmp_path / "cpu", tmp_path / "gpu"
    for ratio, top1, tps in ((0.05, 0.9, 150.0), (0.1, 0.95, 120.0)):
        _write(cpu, f"clo{ratio}", _fidelity_record("clo", ratio, top1, eta=0.8))
        _write(gpu, f"clo{ratio}", _gpu_record("clo", ratio, tps, eta=0.8))
    _write(cpu, "retro", _fidelity_record("retroinfer", 0.2, 0.97))  # no GPU record at 20 %: not drawn
    matched = fidelity_frontier.plot(cpu, gpu, tmp_path / "frontier")
    assert sorted((c["config"]["system"]["topk_ratio"], g["metrics"]["decode_tokens_per_s"]) for c, g in matched) == [
        (0.05, 150.0),
        (0.1, 120.0),
    ]
    assert (tmp_path / "frontier.png").exists()
    _write(gpu, "clo_eta", _gpu_record("clo", 0.05, 999.0, eta=0.7))  # the faster run wins, with other settings
    with pytest.raises(RecordError, match="eta=0.8.*eta=0.7"):
        fidelity_frontier.pairs(cpu, gpu)


def test_findings_pair_fp8_with_a_clo_run_that_names_its_dtype():
    """At 8K the model-dtype run is `clo kv_dtype=model`: it is CLO at its defaults, the base FP8 is paired with;
    without any CLO at its defaults a length has no findings (and the README no empty heading)."""
    from plots.fidelity_findings import findings

    def rec(label, top1):
        docs = [{"doc": f"d{i}", "top1": t, "kl": 0.1 * (1 - t)} for i, t in enumerate(top1)]
        return {"label": label, "per_document": docs, "summary": {"top1": {"mean": sum(top1) / len(top1)}}}

    model, fp8 = rec("clo kv_dtype=model", [0.9, 0.8, 0.95, 0.7]), rec("clo kv_dtype=fp8", [0.9, 0.8, 0.9, 0.7])
    said = findings([model, fp8])
    assert said[0].startswith("FP8 host rows minus the same system's model-dtype rows")
    assert "clo -1.25 points" in said[0]
    assert findings([fp8]) == []
