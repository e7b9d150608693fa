"""The run command as a user runs it, and the record it writes: the default needle run, runs with W&B offline, a
trace and huge pages, the Figure 2/10 bundles as one command, and a record's provenance (commit, manifest, package
versions, thread settings, file mode)."""

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from kvoffload.errors import ConfigError
from tests.run_helpers import FAST, ROOT, bad, records, run


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


@pytest.mark.slow
def test_run_identity_follows_values_not_spelling(tmp_path):
    """seqlen=0.125k and seqlen=128 are one run: the second skips the first; 0.50 and 0.5 likewise."""
    run("seqlen=0.125k", "workload.needle_depth=0.50", *FAST, "workload.gen_tokens=2", tmp=tmp_path)
    again = run("seqlen=128", "workload.needle_depth=0.5", *FAST, "workload.gen_tokens=2", tmp=tmp_path)
    assert "skip:" in again.stderr
    (name,) = records(tmp_path)
    assert "seqlen=128," in name and "workload.needle_depth=0.5," in name


@pytest.mark.slow
def test_records_are_complete_json_with_provenance(tmp_path):
    run("seqlen=64", *FAST, tmp=tmp_path)
    (rec,) = records(tmp_path).values()
    assert rec["weights"].startswith("synthetic") and rec["prompt"]["kind"] == "random"
    assert rec["metrics"]["decode_steps"] == 3 and len(rec["steps"]) == 3
    assert rec["metrics"]["decode_steps_measured"] == 1  # two warm-up steps left out of the means
    assert {"torch", "transformers", "git", "device"} <= set(rec["environment"])
    assert not list((tmp_path / "results").rglob("*.tmp"))


@pytest.mark.slow
def test_wandb_offline_run(tmp_path):
    p = run("seqlen=64", *FAST[:-1], "wandb.enabled=true", "wandb.mode=offline", f"wandb.dir={tmp_path}", tmp=tmp_path)
    (folder,) = (tmp_path / "wandb").glob("offline-run-*")
    assert f"[wandb] logged offline to {folder} " in p.stderr


@pytest.mark.slow
def test_huge_pages_restart_the_run_with_glibcs_tunable(tmp_path):
    """hardware.pin_huge_pages: experiments.run starts itself again with glibc's huge-page tunable (read only when
    a process starts), and the record says its tunables (on a CPU nothing is pinned: no huge-page figure)."""
    env_before = os.environ.get("GLIBC_TUNABLES")
    run("hardware.pin_threads=2", "hardware.pin_huge_pages=true", "seqlen=64", *FAST, tmp=tmp_path)
    (rec,) = records(tmp_path).values()
    assert "glibc.malloc.hugetlb=1" in rec["environment"]["glibc_tunables"]
    assert rec["environment"]["process_huge_pages_gb_after_allocate"] is None
    assert os.environ.get("GLIBC_TUNABLES") == env_before
    assert "needs hardware.pin_threads > 0" in bad(tmp_path, "hardware.pin_huge_pages=true", "seqlen=64", *FAST)
    mixed = bad(tmp_path, "--multirun", "hardware.pin_threads=2", "hardware.pin_huge_pages=false,true", *FAST)
    assert "mixing hardware.pin_huge_pages=true and false needs job_process=fresh" in mixed


@pytest.mark.slow
def test_a_fresh_sweep_gives_each_job_the_huge_pages_it_asks(tmp_path):
    args = ("--multirun", "hardware.pin_threads=2", "hardware.pin_huge_pages=false,true", "job_process=fresh")
    run(*args, "seqlen=64", *FAST, tmp=tmp_path)
    recs = {r["config"]["hardware"]["pin_huge_pages"]: r["environment"] for r in records(tmp_path).values()}
    assert "glibc.malloc.hugetlb=1" in recs[True]["glibc_tunables"]
    assert "hugetlb" not in (recs[False]["glibc_tunables"] or "")


@pytest.mark.parametrize("asks,has", [(True, False), (False, True)])
def test_a_run_whose_process_has_other_huge_pages_than_it_asks_is_refused(monkeypatch, asks, has):
    from experiments.runner import execute, run_settings

    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1" if has else "glibc.malloc.arena_max=2")
    numbers = run_settings.RunNumbers(64, 1, 0, 4, 0, 0.5, None, None, pin_threads=4, pin_huge_pages=asks)
    with pytest.raises(ConfigError, match="mixing true and false needs job_process=fresh"):
        execute.check_huge_pages(numbers)
    execute.check_huge_pages(replace(numbers, pin_threads=0, pin_huge_pages=False))  # cudaHostAlloc: no matter


def test_thp_env_adds_or_removes_only_the_huge_page_tunable():
    from kvoffload.offload.host import thp_env

    env = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=0", "X": "1"}
    assert thp_env(env)["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert thp_env(env, on=False) == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "X": "1"}
    assert thp_env({"X": "1"}, on=False) == {"X": "1"}


@pytest.mark.slow
def test_fig2_experiment_runs_every_system_and_plots(tmp_path):
    """The Figure 2 bundle as one command (tiny here: SmolLM2 shapes, synthetic weights, 1500 tokens)."""
    from plots.fig2_breakdown import plot

    run(
        "--multirun",
        "+experiment=fig2_breakdown",
        "model=smollm2",
        "model.weights=synthetic",
        "seqlen=1500",
        "model.reuse_profile=data/profiles/smollm2.json",
        "workload.query_process=data/profiles/smollm2.json",
        "workload.gen_tokens=5",
        "decode_mode=eager",
        tmp=tmp_path,
    )  # piecewise graphs need CUDA
    recs = records(tmp_path)
    assert sorted(r["system"] for r in recs.values()) == ["clo", "fullattn", "infinigen", "pqcache", "retroinfer"]
    assert all(r["status"] == "ok" and "synthetic AR(1)" in r["query_process"] for r in recs.values())
    rows = plot(tmp_path / "results", tmp_path / "fig2.png")
    assert rows["fullattn"]["percent_of_fullattn"] == pytest.approx(100.0)
    assert rows["retroinfer"]["cache_mgmt"] > 0 and rows["clo"]["cache_mgmt"] > 0 and rows["pqcache"]["cache_mgmt"] > 0


@pytest.mark.slow
def test_fig10_experiment_sweeps_batch_and_plots(tmp_path):
    """The Figure 10 bundle as one command (tiny here: SmolLM2 shapes, synthetic weights, 600 tokens, no budget)."""
    from plots.fig10_throughput import data

    run(
        "--multirun",
        "+experiment=fig10_throughput",
        "model=smollm2",
        "model.weights=synthetic",
        "seqlen=600",
        "batch=1,2",
        "system=clo",
        "hardware.gpu_mem_gb=null",
        "model.reuse_profile=data/profiles/smollm2.json",
        "workload.query_process=data/profiles/smollm2.json",
        "workload.gen_tokens=4",
        "decode_mode=eager",
        tmp=tmp_path,
    )
    recs = records(tmp_path)
    assert sorted((r["system"], r["batch"]) for r in recs.values()) == [("clo", 1), ("clo", 2)]
    assert all(r["kv_fill"].startswith("key_process") for r in recs.values())
    points = data(tmp_path / "results")["points"]
    assert all(p["decode_tokens_per_s"] > 0 for p in points.values()) and len(points) == 2


def test_the_launchers_commit_wins_over_a_stale_git(monkeypatch):
    """The GPU machine's copy of the tree carries a .git whose HEAD is not the commit its files come from."""
    from experiments.runner.records import git_commit

    monkeypatch.setenv("CLO_GIT_COMMIT", "abc1234")
    got = git_commit(ROOT)
    assert got["commit"] == "abc1234" and got["from"] == "CLO_GIT_COMMIT" and got["local_git_head"]
    monkeypatch.delenv("CLO_GIT_COMMIT")
    assert git_commit(ROOT)["commit"] == got["local_git_head"]


def test_a_local_run_is_dirty_only_for_changed_code(tmp_path):
    """A record's dirty flag counts the code files the manifest would (scripts/tree_manifest.py): a sweep that
    rewrites a committed record leaves its tree clean; a changed .py or .yaml does not."""
    import subprocess

    from experiments.runner.records import CODE_SUFFIXES, git_commit

    script = (ROOT / "scripts" / "tree_manifest.py").read_text()
    assert repr(CODE_SUFFIXES).replace("'", '"') in script, "scripts/tree_manifest.py counts other files as code"
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "record.json").write_text("{}")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    (tmp_path / "results" / "record.json").unlink()
    assert git_commit(tmp_path)["dirty"] is False
    (tmp_path / "a.py").write_text("x = 2\n")
    got = git_commit(tmp_path)
    assert got["dirty"] is True and got["changed"] == ["a.py"]


def test_a_copy_of_the_tree_is_checked_against_its_manifest(tmp_path):
    """On the GPU machine's copy (CLO_GIT_COMMIT set, a stale .git) the carried manifest of the commit's code files
    (scripts/tree_manifest.py) tells a record whether the files are that commit's: dirty False, True naming the
    changed file, or None where there is no manifest or it is of another commit."""
    import json
    import subprocess

    from experiments.runner.records import _manifest_check, manifest_check

    (tmp_path / "a.py").write_text("x = 1\n")
    blob = subprocess.run(["git", "hash-object", str(tmp_path / "a.py")], capture_output=True, text=True).stdout
    manifest = tmp_path / ".tree_manifest.json"
    assert manifest_check(tmp_path, "abc1234")["dirty"] is None  # no manifest: not checked
    manifest.write_text(json.dumps({"commit": "abc1234" + "0" * 33, "files": {"a.py": blob.strip()}}))
    _manifest_check.cache_clear()
    assert manifest_check(tmp_path, "abc1234")["dirty"] is False
    assert manifest_check(tmp_path, "def5678")["dirty"] is None  # a manifest of another commit says nothing
    (tmp_path / "a.py").write_text("x = 2\n")
    _manifest_check.cache_clear()
    got = manifest_check(tmp_path, "abc1234")
    assert got["dirty"] is True and got["changed"] == ["a.py"]
    _manifest_check.cache_clear()


@pytest.mark.slow
def test_trace_dir_writes_one_decode_step(tmp_path):
    """trace_dir=: the profiler records one steady step (here, on a CPU, its operators) into a Chrome trace."""
    run(
        "seqlen=64",
        *FAST,
        "workload.gen_tokens=8",
        "workload.warmup_steps=0",
        "system=clo",
        f"trace_dir={tmp_path / 'trace'}",
        tmp=tmp_path,
    )
    events = json.loads((tmp_path / "trace" / "decode_step.trace.json").read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any("index_copy" in n for n in names)  # the step's own work (the dense layers' KV append)
    trace = tmp_path / "trace" / "decode_step.trace.json"
    p = subprocess.run(
        [sys.executable, "-m", "experiments.traces.step_timeline", str(trace)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0 and "no GPU kernels" in p.stderr


def test_step_timeline_finds_the_compute_streams_gaps():
    from experiments.traces.step_timeline import summary

    ks = [
        {"name": "gemv", "stream": 1, "start": 0.0, "end": 65.0},
        {"name": "topk", "stream": 2, "start": 10.0, "end": 70.0},  # the compute stream (longest kernel) waits for it
        {"name": "attention", "stream": 1, "start": 71.0, "end": 80.0},
    ]
    out = summary(ks, 5)
    assert out["compute_stream"] == 1 and out["span_us"] == 80.0
    assert out["busy_us_by_stream"] == {1: 74.0, 2: 60.0} and out["compute_idle_us"] == 6.0
    gap = {"at_us": 65.0, "idle_us": 6.0, "next": "attention", "next_family": "attention", "after_other_stream": "topk"}
    assert out["largest_gaps"] == [gap]
    assert out["compute_idle_us_by_next"] == [{"next": "attention", "us": 6.0, "gaps": 1}]


def test_the_record_names_the_thread_runtimes_settings(monkeypatch):
    """OMP_*/NUMBA_* change a host-bound step: the environment a record keeps holds them, and nothing else of env."""
    import torch

    from experiments.runner.records import environment

    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setenv("SECRET_TOKEN", "x")
    got = environment(torch.device("cpu"))["thread_env"]
    assert got["OMP_WAIT_POLICY"] == "ACTIVE" and "SECRET_TOKEN" not in got


@pytest.mark.slow
def test_the_record_reads_package_versions_without_importing_them():
    """A forked sweep job imports nothing for its record's versions: importing transformers (and flashinfer on a
    GPU) to read __version__ cost each job a second or more."""
    code = (
        "import sys, torch; from experiments.runner.records import environment; e = environment(torch.device('cpu')); "
        "print(sorted(m for m in ('transformers', 'flashinfer') if m in sys.modules)); "
        "import transformers; print(e['transformers'] == transformers.__version__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split() == ["[]", "True"]


def test_records_are_readable_as_the_umask_allows(tmp_path):
    """A record is written through a temporary file (mkstemp makes it 0600); it ends with open()'s mode, so that a
    group on a shared cluster can read the results."""
    from kvoffload.paths import UMASK, write_json_atomic

    path = tmp_path / "record.json"
    write_json_atomic(path, {"status": "ok"})
    assert path.stat().st_mode & 0o777 == 0o666 & ~UMASK


def test_an_answer_cut_off_by_gen_tokens_is_named_so():
    from experiments.run import cut_off

    assert cut_off("The pass key is 604", "60494")
    assert not cut_off("The pass key is 60494.", "60494") and not cut_off("The pass key is 6", "60494")
