"""The run command as a user runs it: the default needle run, a sweep that survives a failing run and resumes,
W&B offline logging, and bad input refused with a clear message before any long work."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from kvoffload.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
FAST = ["model.weights=synthetic", "workload.prompt=random", "workload.gen_tokens=4", "wandb.enabled=false"]


def run(*args: str, tmp: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_SILENT": "true", "HYDRA_FULL_ERROR": "0"}
    flags = [a for a in args if a.startswith("--")]  # hydra wants its flags before the overrides
    overrides = [a for a in args if not a.startswith("--")]
    if not any(a.startswith("wandb.dir=") for a in overrides):  # the bundles log to W&B: offline runs stay in tmp
        overrides.append(f"wandb.dir={tmp}")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.run",
            *flags,
            f"results_dir={tmp / 'results'}",
            f"hydra.run.dir={tmp / 'out'}",
            f"hydra.sweep.dir={tmp / 'multi'}",
            *overrides,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
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


def sweep_table(stderr: str) -> dict[str, tuple[str, str]]:
    """The end-of-sweep table: {the job's overrides: (status, error)}."""
    lines = stderr[stderr.index("[sweep]") :].splitlines()[1:]
    rows = {}
    for line in lines:
        left, _, error = line.partition("  error: ")
        _num, status, overrides = left.split(maxsplit=2)
        rows[overrides.strip()] = (status, error)
    return rows


def ok_commit(recs: dict) -> str:
    (commit,) = {r["environment"]["git"]["commit"] for r in recs.values() if r["status"] == "ok"}
    return commit


@pytest.mark.slow
def test_sweep_survives_a_failing_run_and_resumes(tmp_path):
    p = run("--multirun", "seqlen=64,96,9000", *FAST, tmp=tmp_path, check=False)
    assert p.returncode == 1, p.stderr[-3000:]  # a job failed: the sweep ran on, then says so
    recs = records(tmp_path)
    status = {name.split("-")[0]: r["status"] for name, r in recs.items()}
    assert sorted(status.values()) == ["failed", "ok", "ok"], status
    failed = next(r for r in recs.values() if r["status"] == "failed")
    assert "max_position_embeddings" in failed["error"] and failed["error_kind"] == "config"
    assert failed["environment"]["git"]["commit"] == ok_commit(recs)  # a failure names its commit as a run does
    assert "the sweep continues" in p.stderr
    assert "[sweep] 3 jobs: 2 ok, 0 skipped, 1 failed" in p.stderr
    table = sweep_table(p.stderr)
    assert table["seqlen=64"] == ("ok", "") and table["seqlen=96"] == ("ok", "")
    assert table["seqlen=9000"][0] == "failed" and "max_position_embeddings=8192" in table["seqlen=9000"][1]
    again = run("--multirun", "seqlen=64,96,9000", *FAST, tmp=tmp_path, check=False)
    assert again.returncode == 1
    assert again.stderr.count("skip:") == 2  # finished runs are skipped, the failed one is retried
    assert "[sweep] 3 jobs: 0 ok, 2 skipped, 1 failed" in again.stderr


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fresh", "fork"])
def test_job_processes_of_their_own_keep_records_failures_skips_and_the_table(tmp_path, mode):
    args = ("--multirun", "seqlen=64,96,9000", f"job_process={mode}", *FAST)
    p = run(*args, tmp=tmp_path, check=False)
    assert p.returncode == 1, p.stderr[-3000:]
    recs = {next(i for i in r["identity"] if i.startswith("seqlen=")): r for r in records(tmp_path).values()}
    assert {k: r["status"] for k, r in recs.items()} == {"seqlen=64": "ok", "seqlen=96": "ok", "seqlen=9000": "failed"}
    pids = {recs[k]["environment"]["pid"] for k in ("seqlen=64", "seqlen=96")}
    assert len(pids) == 2  # each job ran in a process of its own
    stages = recs["seqlen=64"]["stages"]
    assert list(stages) == ["startup", "device", "measure", "weights", "allocate", "fill", "first_step", "decode"]
    assert all(v["s"] >= 0 for v in stages.values())
    if mode == "fresh":
        assert stages["startup"]["s"] > 0.5  # a new interpreter's imports take a while (a fork's are done)
    assert "max_position_embeddings" in recs["seqlen=9000"]["error"]
    assert "[sweep] 3 jobs: 2 ok, 0 skipped, 1 failed" in p.stderr
    again = run(*args, tmp=tmp_path, check=False)
    assert "[sweep] 3 jobs: 0 ok, 2 skipped, 1 failed" in again.stderr


@pytest.mark.slow
def test_a_sweep_whose_every_job_fails_exits_1_with_the_table(tmp_path):
    p = run("--multirun", "seqlen=9000,10000", "system=clo", "system.eta=1.5", *FAST, tmp=tmp_path, check=False)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "[sweep] 2 jobs: 0 ok, 0 skipped, 2 failed (all with " in p.stderr
    table = sweep_table(p.stderr)
    assert set(table) == {"seqlen=9000", "seqlen=10000"}
    assert all(s == "failed" and e for s, e in table.values())
    assert "Traceback" not in p.stderr


@pytest.mark.slow
def test_a_sweep_that_only_succeeds_or_skips_exits_0(tmp_path):
    p = run("--multirun", "seqlen=64", *FAST, tmp=tmp_path)
    assert "[sweep] 1 job: 1 ok, 0 skipped, 0 failed" in p.stderr
    again = run("--multirun", "seqlen=64", *FAST, tmp=tmp_path)
    assert "[sweep] 1 job: 0 ok, 1 skipped, 0 failed" in again.stderr


def single_error(p: subprocess.CompletedProcess) -> str:
    """A refused run: exit status 2 and exactly one line on stderr, `error: ...`, before any long work."""
    assert p.returncode == 2, p.stderr[-3000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr[-3000:]
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,message",
    [
        (["system=clo", "system.eta=1.5"], "system=clo: eta=1.5"),
        (["system=clo", "system.topk_ratio=0"], "system=clo: topk_ratio=0"),
        (["system=clo", "system.topk=bogus"], "valid: radix, torch"),
        (["system=infinigen", "system.channel_fraction=0"], "system=infinigen: channel_fraction=0"),
    ],
)
def test_a_systems_own_bad_setting_is_a_config_error(tmp_path, args, message):
    """Raised in the system's constructor, inside hydra.utils.instantiate: one line and status 2, like the
    runner's own checks, not Hydra's "Error in call to target" wrapper."""
    line = single_error(run(*args, "seqlen=64", *FAST, tmp=tmp_path, check=False))
    assert message in line and "Error in call to target" not in line
    (rec,) = records(tmp_path).values()
    assert rec["status"] == "failed" and rec["error_kind"] == "config" and message in rec["error"]


@pytest.mark.slow
def test_a_systems_bad_setting_in_a_sweep_is_recorded_as_config(tmp_path):
    p = run("--multirun", "system=clo", "system.eta=1.5", "seqlen=64", *FAST, tmp=tmp_path, check=False)
    assert p.returncode == 1 and "FAILED (config): system=clo: eta=1.5" in p.stderr
    (rec,) = records(tmp_path).values()
    assert rec["error_kind"] == "config"


@pytest.mark.slow
@pytest.mark.parametrize(
    "arg,message",
    [
        ("batch=abc", "batch='abc': expected a whole number"),
        ("hardware.gpu_mem_gb=lots", "hardware.gpu_mem_gb='lots': expected a number or null"),
        ("workload.gen_tokens=0", "workload.gen_tokens=0 must be at least 1"),
        ("hardware.pin_threads=500", "hardware.pin_threads=500 must be at most 128"),
        ("hardware.pin_threads=12", "hardware.pin_threads=12: expected 0 or a power of two"),
    ],
)
def test_bad_numbers_are_one_line(tmp_path, arg, message):
    assert message in single_error(run("seqlen=64", *FAST, arg, tmp=tmp_path, check=False))


@pytest.mark.slow
@pytest.mark.parametrize("arg", ["+sytem=clo", "sytem=clo", "++sytem=clo"])
def test_a_typod_top_level_key_is_refused(tmp_path, arg):
    """`sytem=clo` got Hydra's hint `+sytem=clo`, which then ran FullAttn and exited 0."""
    line = single_error(run(arg, "seqlen=64", *FAST, tmp=tmp_path, check=False))
    assert "'sytem'" in line and "did you mean system?" in line and "seqlen" in line and "experiment" in line
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
def test_a_new_setting_appended_to_a_system_is_refused(tmp_path):
    line = single_error(run("system=clo", "+system.etaa=0.5", "seqlen=64", *FAST, tmp=tmp_path, check=False))
    assert "system.etaa" in line and "conf/system/" in line


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


def bad(tmp, *args):
    p = run(*args, tmp=tmp, check=False)
    assert p.returncode != 0
    return p.stderr


@pytest.mark.slow
def test_unknown_names_list_the_valid_ones(tmp_path):
    assert "fullattn" in bad(tmp_path, "system=nope")
    err = bad(tmp_path, "model=nope")
    assert "llama3" in err and "qwen25" in err and "smollm2" in err
    assert "decode" in bad(tmp_path, "workload=nope")


@pytest.mark.slow
def test_seqlen_beyond_max_positions(tmp_path):
    assert "max_position_embeddings=8192" in bad(tmp_path, "seqlen=8k", *FAST)


@pytest.mark.slow
@pytest.mark.parametrize("system", ["fullattn", "clo"])
def test_llama3_128k_refused_on_this_machine_with_estimate(tmp_path, system):
    err = bad(tmp_path, f"system={system}", "model=llama3", "seqlen=128k", "device=cpu", "wandb.enabled=false")
    assert "GB" in err and "available" in err and "Ways out" in err
    assert "Traceback" not in err and "[run]" not in err  # refused before the weights load
    assert "instead of fullattn" not in err and "offloading system" not in err  # RAM is short: offloading adds none
    assert "model=smollm2" in err and "more RAM" in err


@pytest.mark.slow
def test_profile_refuses_to_overwrite_a_profile(tmp_path):
    """The README's profiling command named the committed data/profiles/smollm2.json and overwrote it."""
    committed = ROOT / "data" / "profiles" / "smollm2.json"
    before = committed.read_bytes()
    for out in ([f"+profile_out={committed.relative_to(ROOT)}"], []):  # as the README had it, and the default
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "experiments.producers.profile",
                "model=smollm2",
                "seqlen=3k",
                "workload.gen_tokens=64",
                "workload.stop_at_eos=false",
                f"hydra.run.dir={tmp_path / 'o'}",
                *out,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        line = single_error(p)
        assert "smollm2.json exists" in line and "force=true" in line
    assert committed.read_bytes() == before


@pytest.mark.slow
def test_profile_overwrites_with_force_true(tmp_path):
    mine = tmp_path / "mine.json"
    mine.write_text("{}")
    args = [
        sys.executable,
        "-m",
        "experiments.producers.profile",
        "model=smollm2",
        "seqlen=256",
        "workload.gen_tokens=4",
        "workload.stop_at_eos=false",
        f"hydra.run.dir={tmp_path / 'o'}",
        f"+profile_out={mine}",
    ]
    assert "exists" in single_error(subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120))
    assert mine.read_text() == "{}"
    p = subprocess.run([*args, "force=true"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(json.loads(mine.read_text())["s_hat"]) == 30


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
def test_gpu_budget_too_small(tmp_path):
    err = bad(tmp_path, "hardware.gpu_mem_gb=0.05", "seqlen=64", *FAST)
    assert "the budget is 0.05 GB (hardware.gpu_mem_gb), less than smollm2's weights alone" in err


@pytest.mark.slow
def test_weights_path_missing(tmp_path):
    assert "does not exist" in bad(tmp_path, f"model.path={tmp_path / 'nowhere'}", "seqlen=64", *FAST[1:])


@pytest.mark.slow
def test_weights_path_with_other_shapes(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path / "tiny"
    LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=100,
        )
    ).save_pretrained(folder)
    err = bad(tmp_path, f"model.path={folder}", "seqlen=64", *FAST[1:])
    assert "does not match model=smollm2" in err and "hidden_size" in err


@pytest.mark.slow
def test_graph_decode_on_cpu_is_refused(tmp_path):
    assert "needs CUDA" in bad(tmp_path, "decode_mode=graph", "seqlen=64", *FAST)
    assert "needs CUDA" in bad(tmp_path, "decode_mode=piecewise", "seqlen=64", *FAST)


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


@pytest.mark.slow
def test_accuracy_workload_is_pointed_to_its_command(tmp_path):
    assert "python -m experiments.accuracy" in bad(tmp_path, "workload=accuracy", *FAST[:1])


@pytest.mark.slow
def test_bad_workload_settings_refused_before_loading(tmp_path):
    err = bad(tmp_path, "workload.prompt=poem", "seqlen=64", *FAST[:1], *FAST[2:])
    assert "valid: auto, needle, random" in err and "[run]" not in err
    err = bad(tmp_path, "workload.query_process=data/profiles/nope.json", "seqlen=64", *FAST)
    assert "no such file" in err and "[run]" not in err


def test_the_launchers_commit_wins_over_a_stale_git(monkeypatch):
    """The GPU machine's copy of the tree carries a .git whose HEAD is not the commit its files come from."""
    from experiments.runner.records import git_commit

    monkeypatch.setenv("CLO_GIT_COMMIT", "abc1234")
    got = git_commit(ROOT)
    assert got["commit"] == "abc1234" and got["from"] == "CLO_GIT_COMMIT" and got["local_git_head"]
    monkeypatch.delenv("CLO_GIT_COMMIT")
    assert git_commit(ROOT)["commit"] == got["local_git_head"]


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


def test_a_refusal_at_this_commit_is_finished_a_crash_is_not(tmp_path, monkeypatch):
    """A sweep skips a point whose record ended ok or is the preflight's fit refusal at this commit (so a resumed
    device call does not check every refusal again); a refusal of another commit or a dirty tree, a crash and a
    damaged record run again."""
    import json

    from experiments.runner.records import finished

    monkeypatch.setenv("CLO_GIT_COMMIT", "abc1234")
    refusal = {"status": "failed", "error_kind": "config", "error": "system=clo ... needs about 52.7 GB of GPU memory"}

    def record(name: str, rec: dict | None, commit: str = "abc1234", dirty: bool | None = None, text: str = ""):
        path = tmp_path / name / "record.json"
        path.parent.mkdir()
        git = {"commit": commit, "dirty": dirty}
        path.write_text(text or json.dumps({**(rec or {}), "environment": {"git": git}}))
        return path

    assert finished(record("ok", {"status": "ok"}))
    assert finished(record("refused", refusal))
    assert not finished(record("refused_elsewhere", refusal, commit="def5678"))
    assert not finished(record("refused_dirty", refusal, dirty=True))
    assert not finished(record("crashed", {"status": "failed", "error_kind": "crash", "error": "AssertionError"}))
    assert not finished(record("damaged", None, text="{"))
    assert not finished(tmp_path / "never" / "record.json")


@pytest.mark.slow
def test_a_sweep_run_again_skips_its_fit_refusals(tmp_path, monkeypatch):
    """A point refused for the host's RAM is recorded with its commit, and the same sweep run again at that commit
    skips it as it skips a finished run."""
    monkeypatch.setenv("CLO_GIT_COMMIT", "abc1234")  # what the device launcher sets; run() passes os.environ on
    args = ("--multirun", "system=clo", "seqlen=4k", "batch=8192", *FAST)  # thousands of GB: refused on any host
    p = run(*args, tmp=tmp_path, check=False)
    assert p.returncode == 1 and "needs about" in p.stderr and "GB of RAM on this host" in p.stderr, p.stderr[-2000:]
    (rec,) = records(tmp_path).values()
    assert rec["error_kind"] == "config" and rec["environment"]["git"]["commit"] == "abc1234"
    assert rec["environment"]["torch"] and rec["environment"]["device"] == "cpu"  # the environment, as a run's
    again = run(*args, tmp=tmp_path, check=False)
    assert again.returncode == 0 and "[sweep] 1 job: 0 ok, 1 skipped, 0 failed" in again.stderr, again.stderr[-2000:]


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


def test_sweep_summary_table_counts_every_outcome():
    """records.SweepSummary as Hydra's basic launcher drives it, with a job that raised (a crash outside task)."""
    from types import SimpleNamespace

    from hydra.core.utils import JobReturn, JobStatus
    from omegaconf import OmegaConf

    from experiments.runner.records import SweepSummary

    cb = SweepSummary()
    cb.on_multirun_start(config=None)
    outcomes = [
        ({"status": "ok"}, JobStatus.COMPLETED),
        ({"status": "skipped"}, JobStatus.COMPLETED),
        ({"status": "failed", "error": "seqlen=9000 exceeds it"}, JobStatus.COMPLETED),
        (RuntimeError("boom\nsecond line"), JobStatus.FAILED),
        (None, JobStatus.COMPLETED),
    ]
    for i, (value, status) in enumerate(outcomes):
        ret = JobReturn(overrides=[f"seqlen={i}", "model=smollm2", "results_dir=/tmp/r"], status=status)
        ret._return_value = value
        cb.on_job_end(config=OmegaConf.create({"hydra": {"job": {"num": i}}}), job_return=ret)
    table = cb.table()
    assert table.splitlines()[0] == "[sweep] 5 jobs: 2 ok, 1 skipped, 2 failed (all with model=smollm2)"
    assert "#2  failed   seqlen=2  error: seqlen=9000 exceeds it" in table
    assert "#3  failed   seqlen=3  error: RuntimeError: boom; second line" in table
    assert len(table.splitlines()) == 6 and "results_dir" not in table
    with pytest.raises(SystemExit) as e:
        cb.on_multirun_end(config=None)
    assert e.value.code == 1
    cb.on_job_end(
        config=OmegaConf.create({"hydra": {"job": {"num": 0}}}),
        job_return=SimpleNamespace(
            overrides=["seqlen=1"], status=JobStatus.COMPLETED, _return_value={"status": "skipped"}
        ),
    )
    cb.on_multirun_end(config=None)  # nothing failed: no exit


@pytest.mark.slow
def test_fresh_job_processes_see_the_sweeps_config_dir(tmp_path):
    """A --config-dir (a user's own bundles) reaches each job's fresh process: its experiment composes there too."""
    conf = tmp_path / "myconf" / "experiment"
    conf.mkdir(parents=True)
    (conf / "mine.yaml").write_text("# @package _global_\nseqlen: 80\n")
    p = run("--multirun", f"--config-dir={conf.parent}", "+experiment=mine", "job_process=fresh", *FAST, tmp=tmp_path)
    (rec,) = records(tmp_path).values()
    assert rec["status"] == "ok" and rec["config"]["seqlen"] == 80, p.stderr[-3000:]


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


def test_a_forked_job_killed_without_a_record_gets_a_failed_one(tmp_path):
    """A child that dies by a signal (the OOM killer's) leaves no record: the sweep writes a failed one and goes on,
    also where a failed record of an earlier sweep lay (its old error is not this run's)."""
    from experiments.runner.job_process import run_in_forked_child

    path = tmp_path / "run" / "record.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"status": "failed", "error": "an earlier sweep's error"}))
    outcome = run_in_forked_child(lambda: os.kill(os.getpid(), signal.SIGKILL), ["seqlen=64"], path)
    rec = json.loads(path.read_text())
    assert outcome["status"] == "failed" and rec["status"] == "failed" and rec["error_kind"] == "crash"
    assert "status -9" in rec["error"] and rec["overrides"] == ["seqlen=64"]


def test_a_forked_jobs_record_is_its_outcome_whatever_its_exit_status(tmp_path):
    """A child that wrote its ok record and then failed (in its W&B log, say) ran: its record stands, as inline."""
    from experiments.runner.job_process import run_in_forked_child
    from kvoffload.paths import write_json_atomic

    path = tmp_path / "record.json"

    def job():
        write_json_atomic(path, {"status": "ok"})
        raise RuntimeError("after the record")

    assert run_in_forked_child(job, ["seqlen=64"], path)["status"] == "ok"
    assert json.loads(path.read_text()) == {"status": "ok"}


def test_stop_child_ends_and_reaps_a_job_that_outlives_its_sweep():
    from experiments.runner.job_process import stop_child

    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a job deaf to SIGTERM: SIGKILL after the grace period
        os.write(ready_w, b"x")
        time.sleep(60)
        os._exit(0)
    os.read(ready_r, 1)
    start = time.monotonic()
    stop_child(pid, grace_s=0.5)
    assert 0.5 <= time.monotonic() - start < 10  # the grace period, then SIGKILL
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, 0)  # reaped


@pytest.mark.slow
def test_a_forked_job_ends_when_its_sweep_is_killed(tmp_path):
    """A sweep process killed by pid (SIGKILL: no handler runs) takes its forked job with it."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    child_pid = tmp_path / "child.pid"
    code = (
        "import os, time, pathlib; from experiments.runner.job_process import run_in_forked_child\n"
        f"def job():\n    pathlib.Path({str(child_pid)!r}).write_text(str(os.getpid())); time.sleep(120)\n"
        f"run_in_forked_child(job, [], pathlib.Path({str(tmp_path / 'record.json')!r}))\n"
    )
    sweep = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    deadline = time.monotonic() + 60
    while not child_pid.exists() or not child_pid.read_text():
        assert time.monotonic() < deadline and sweep.poll() is None
        time.sleep(0.1)
    job = int(child_pid.read_text())
    sweep.kill()
    sweep.wait()
    deadline = time.monotonic() + 10
    try:
        while Path(f"/proc/{job}").exists() and Path(f"/proc/{job}/stat").read_text().split(")")[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the job outlived its sweep"
            time.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(job, signal.SIGKILL)


def test_a_forked_job_leaves_no_temporary_files(tmp_path, monkeypatch):
    """os._exit skips atexit cleanup (W&B removes its temp folders there): a job's temp folder goes when it ends."""
    import tempfile

    from experiments.runner.job_process import run_in_forked_child
    from kvoffload.paths import write_json_atomic

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = tmp_path / "record.json"

    def job():
        Path(tempfile.mkdtemp(), "left.txt").write_text("x")
        write_json_atomic(path, {"status": "ok"})
        return {"status": "ok"}

    assert run_in_forked_child(job, ["seqlen=64"], path)["status"] == "ok"
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]


@pytest.mark.skipif(sys.version_info < (3, 12), reason="Python warns of a multi-threaded fork from 3.12")
def test_a_fork_beside_a_python_thread_keeps_pythons_warning(tmp_path):
    """Only native pools' threads are forgiven at the fork: a Python thread still running may hold a lock the
    child needs, and Python's multi-threaded-fork warning says so."""
    import threading

    from experiments.runner.job_process import run_in_forked_child
    from kvoffload.paths import write_json_atomic

    path = tmp_path / "record.json"
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)
    worker.start()
    try:
        with pytest.warns(DeprecationWarning, match="fork"):
            run_in_forked_child(lambda: write_json_atomic(path, {"status": "ok"}) or {"status": "ok"}, [], path)
    finally:
        stop.set()
        worker.join()


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
