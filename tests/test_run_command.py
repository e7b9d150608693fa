"""The run command as a user runs it: the default needle run, a sweep that survives a failing run and resumes,
W&B offline logging, and bad input refused with a clear message before any long work."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAST = ["model.weights=synthetic", "workload.prompt=random", "workload.gen_tokens=4", "wandb.enabled=false"]


def run(*args: str, tmp: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_SILENT": "true", "HYDRA_FULL_ERROR": "0"}
    flags = [a for a in args if a.startswith("--")]  # hydra wants its flags before the overrides
    overrides = [a for a in args if not a.startswith("--")]
    p = subprocess.run([sys.executable, "-m", "experiments.run", *flags, f"results_dir={tmp / 'results'}",
                        f"hydra.run.dir={tmp / 'out'}", f"hydra.sweep.dir={tmp / 'multi'}", *overrides],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def records(tmp: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in (tmp / "results").glob("*/record.json")}


@pytest.mark.slow
def test_default_run_finds_the_needle_with_real_weights(tmp_path):
    p = run("wandb.enabled=false", tmp=tmp_path)
    (rec,) = records(tmp_path).values()
    assert rec["status"] == "ok" and rec["answer"]["found"] is True, rec["answer"]
    assert "real SmolLM2" in rec["weights"] and rec["prompt"]["kind"] == "needle"
    assert rec["prompt"]["tokens"] == 3072
    m = rec["metrics"]
    assert m["decode_tokens_per_s"] > 0 and m["dense_floor_ms_per_step"] > 0
    assert m["phase_ms_per_step"]["attention"] > 0
    assert rec["environment"]["git"]["commit"] and rec["config"]["model"]["name"] == "smollm2"
    assert "FOUND" in p.stdout


def test_sweep_survives_a_failing_run_and_resumes(tmp_path):
    p = run("--multirun", "seqlen=64,96,9000", *FAST, tmp=tmp_path)
    recs = records(tmp_path)
    status = {name.split("-")[0]: r["status"] for name, r in recs.items()}
    assert sorted(status.values()) == ["failed", "ok", "ok"], status
    failed = next(r for r in recs.values() if r["status"] == "failed")
    assert "max_position_embeddings" in failed["error"] and failed["error_kind"] == "config"
    assert "the sweep continues" in p.stderr
    again = run("--multirun", "seqlen=64,96,9000", *FAST, tmp=tmp_path)
    assert again.stderr.count("skip:") == 2  # finished runs are skipped, the failed one is retried


def test_records_are_complete_json_with_provenance(tmp_path):
    run("seqlen=64", *FAST, tmp=tmp_path)
    (rec,) = records(tmp_path).values()
    assert rec["weights"].startswith("synthetic") and rec["prompt"]["kind"] == "random"
    assert rec["metrics"]["decode_steps"] == 3 and len(rec["steps"]) == 3
    assert rec["metrics"]["decode_steps_measured"] == 1  # two warm-up steps left out of the means
    assert {"torch", "transformers", "git", "device"} <= set(rec["environment"])
    assert not list((tmp_path / "results").rglob("*.tmp"))


def test_wandb_offline_run(tmp_path):
    run("seqlen=64", *FAST[:-1], "wandb.enabled=true", "wandb.mode=offline", f"wandb.dir={tmp_path}", tmp=tmp_path)
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def bad(tmp, *args):
    p = run(*args, tmp=tmp, check=False)
    assert p.returncode != 0
    return p.stderr


def test_unknown_names_list_the_valid_ones(tmp_path):
    assert "fullattn" in bad(tmp_path, "system=nope")
    err = bad(tmp_path, "model=nope")
    assert "llama3" in err and "qwen25" in err and "smollm2" in err
    assert "decode" in bad(tmp_path, "workload=nope")


def test_seqlen_beyond_max_positions(tmp_path):
    assert "max_position_embeddings=8192" in bad(tmp_path, "seqlen=8k", *FAST)


@pytest.mark.parametrize("system", ["fullattn", "clo"])
def test_llama3_128k_refused_on_this_machine_with_estimate(tmp_path, system):
    err = bad(tmp_path, f"system={system}", "model=llama3", "seqlen=128k", "device=cpu", "wandb.enabled=false")
    assert "GB" in err and "available" in err and "Ways out" in err
    assert "Traceback" not in err and "[run]" not in err  # refused before the weights load


def test_gpu_budget_too_small(tmp_path):
    err = bad(tmp_path, "hardware.gpu_mem_gb=0.05", "seqlen=64", *FAST)
    assert "budget is 0.1 GB" in err or "budget is 0.0 GB" in err


def test_weights_path_missing(tmp_path):
    assert "does not exist" in bad(tmp_path, f"model.path={tmp_path / 'nowhere'}", "seqlen=64", *FAST[1:])


def test_weights_path_with_other_shapes(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path / "tiny"
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=100)).save_pretrained(folder)
    err = bad(tmp_path, f"model.path={folder}", "seqlen=64", *FAST[1:])
    assert "does not match model=smollm2" in err and "hidden_size" in err


def test_graph_decode_on_cpu_is_refused(tmp_path):
    assert "needs CUDA" in bad(tmp_path, "decode_mode=graph", "seqlen=64", *FAST)
    assert "needs CUDA" in bad(tmp_path, "decode_mode=piecewise", "seqlen=64", *FAST)


@pytest.mark.slow
def test_fig2_experiment_runs_every_system_and_plots(tmp_path):
    """The Figure 2 bundle as one command (tiny here: SmolLM2 shapes, synthetic weights, 1500 tokens)."""
    from plots.fig2_breakdown import plot

    run("--multirun", "+experiment=fig2_breakdown", "model=smollm2", "model.weights=synthetic", "seqlen=1500",
        "model.reuse_profile=data/profiles/smollm2.json", "workload.query_process=data/profiles/smollm2.json",
        "workload.gen_tokens=5", "decode_mode=eager", tmp=tmp_path)  # piecewise graphs need CUDA
    recs = records(tmp_path)
    assert sorted(r["system"] for r in recs.values()) == ["clo", "fullattn", "infinigen", "retroinfer"]
    assert all(r["status"] == "ok" and "synthetic AR(1)" in r["query_process"] for r in recs.values())
    rows = plot(tmp_path / "results", tmp_path / "fig2.png")
    assert rows["fullattn"]["percent_of_fullattn"] == pytest.approx(100.0)
    assert rows["retroinfer"]["cache_mgmt"] > 0 and rows["clo"]["cache_mgmt"] > 0


def test_bad_workload_settings_refused_before_loading(tmp_path):
    err = bad(tmp_path, "workload.prompt=poem", "seqlen=64", *FAST[:1], *FAST[2:])
    assert "valid: auto, needle, random" in err and "[run]" not in err
    err = bad(tmp_path, "workload.query_process=data/profiles/nope.json", "seqlen=64", *FAST)
    assert "no such file" in err and "[run]" not in err


def test_the_launchers_commit_wins_over_a_stale_git(monkeypatch):
    """The GPU machine's copy of the tree carries a .git whose HEAD is not the commit its files come from."""
    from experiments.records import git_commit

    monkeypatch.setenv("CLO_GIT_COMMIT", "abc1234")
    got = git_commit(ROOT)
    assert got["commit"] == "abc1234" and got["from"] == "CLO_GIT_COMMIT" and got["local_git_head"]
    monkeypatch.delenv("CLO_GIT_COMMIT")
    assert git_commit(ROOT)["commit"] == got["local_git_head"]


def test_trace_dir_writes_one_decode_step(tmp_path):
    """trace_dir=: the profiler records one steady step (here, on a CPU, its operators) into a Chrome trace."""
    run("seqlen=64", *FAST, "workload.gen_tokens=8", "workload.warmup_steps=0", "system=clo",
        f"trace_dir={tmp_path / 'trace'}", tmp=tmp_path)
    events = json.loads((tmp_path / "trace" / "decode_step.trace.json").read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any("index_copy" in n for n in names)  # the step's own work (the dense layers' KV append)
    trace = tmp_path / "trace" / "decode_step.trace.json"
    p = subprocess.run([sys.executable, "-m", "experiments.step_timeline", str(trace)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "no GPU kernels" in p.stderr


def test_step_timeline_finds_the_compute_streams_gaps():
    from experiments.step_timeline import summary

    ks = [{"name": "gemv", "stream": 1, "start": 0.0, "end": 65.0},
          {"name": "topk", "stream": 2, "start": 10.0, "end": 70.0},  # the compute stream (longest kernel) waits for it
          {"name": "attention", "stream": 1, "start": 71.0, "end": 80.0}]
    out = summary(ks, 5)
    assert out["compute_stream"] == 1 and out["span_us"] == 80.0
    assert out["busy_us_by_stream"] == {1: 74.0, 2: 60.0} and out["compute_idle_us"] == 6.0
    assert out["largest_gaps"] == [{"at_us": 65.0, "idle_us": 6.0, "next": "attention", "after_other_stream": "topk"}]
