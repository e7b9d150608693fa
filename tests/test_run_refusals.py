"""The run command refusing bad input with one `error:` line and exit status 2 before any long work: a system's
own bad setting, bad numbers, a typo'd key, unknown names, a length or model that does not fit, a profile it would
overwrite, weights that are missing or of other shapes, graphs on a CPU, bad workload settings."""

import json
import subprocess
import sys

import pytest

from tests.run_helpers import FAST, ROOT, bad, records, run, single_error


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
def test_accuracy_workload_is_pointed_to_its_command(tmp_path):
    assert "python -m experiments.accuracy" in bad(tmp_path, "workload=accuracy", *FAST[:1])


@pytest.mark.slow
def test_bad_workload_settings_refused_before_loading(tmp_path):
    err = bad(tmp_path, "workload.prompt=poem", "seqlen=64", *FAST[:1], *FAST[2:])
    assert "valid: auto, needle, random" in err and "[run]" not in err
    err = bad(tmp_path, "workload.query_process=data/profiles/nope.json", "seqlen=64", *FAST)
    assert "no such file" in err and "[run]" not in err
