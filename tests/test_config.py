"""Every config group composes, every system instantiates, and the sequence-length syntax parses."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from experiments.runner.setting_types import check_system_settings
from kvoffload.errors import ConfigError
from kvoffload.kv.interface import KVOffloadSystem
from kvoffload.model.config import ModelConfig
from kvoffload.units import parse_tokens

CONF = Path(__file__).resolve().parent.parent / "conf"


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("model", options("model"))
@pytest.mark.parametrize("system", options("system"))
@pytest.mark.parametrize("workload", options("workload"))
def test_every_combination_composes(model, system, workload):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"model={model}", f"system={system}", f"workload={workload}", "seqlen=128k"])
    mc = ModelConfig.from_mapping(cfg.model)
    assert mc.name == model and mc.num_heads % mc.num_kv_heads == 0
    assert isinstance(instantiate(cfg.system), KVOffloadSystem)
    check_system_settings(OmegaConf.to_container(cfg.system, resolve=True))  # its defaults fit its annotations
    assert parse_tokens(cfg.seqlen) == 131072


def test_paper_model_shapes():
    with initialize_config_dir(str(CONF), version_base="1.3"):
        llama = ModelConfig.from_mapping(compose("config", overrides=["model=llama3"]).model)
        qwen = ModelConfig.from_mapping(compose("config", overrides=["model=qwen25"]).model)
    assert (llama.num_layers, llama.num_heads, llama.num_kv_heads, llama.head_dim) == (32, 32, 8, 128)
    assert (qwen.num_layers, qwen.num_heads, qwen.num_kv_heads, qwen.head_dim) == (48, 40, 8, 128)
    assert llama.kv_bytes_per_token(2) == 128 * 1024  # hardware.md: 128 KiB per token
    assert qwen.kv_bytes_per_token(2) == 192 * 1024
    assert 7.9e9 < llama.num_params < 8.1e9 and 14.6e9 < qwen.num_params < 14.9e9


@pytest.mark.parametrize(
    "text,tokens",
    [(4096, 4096), ("4096", 4096), ("4k", 4096), ("128k", 131072), ("128K", 131072), ("1m", 1048576), ("0.5k", 512)],
)
def test_parse_tokens(text, tokens):
    assert parse_tokens(text) == tokens


@pytest.mark.parametrize("bad", ["lots", "12q", "-4k", 0, ""])
def test_parse_tokens_rejects(bad):
    with pytest.raises(ConfigError):
        parse_tokens(bad)


@pytest.mark.parametrize(
    "tokens,text",
    [(4096, "4k"), (131072, "128k"), (1048576, "1m"), (7680, "7680"), (64, "64"), (1536, "1536"), (2 * 1048576, "2m")],
)
def test_tokens_text_is_the_short_spelling(tokens, text):
    from kvoffload.units import tokens_text

    assert tokens_text(tokens) == text and parse_tokens(text) == tokens


# ---- the command line's keys --------------------------------------------------------------------------------
ROOT = CONF.parent


def shown_commands(module: str) -> list[str]:
    """The arguments of every `python -m <module>` command the README, docs/ and the experiment bundles show, as
    text."""
    import re

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((CONF / "experiment").glob("*.yaml"))]
    texts = [p.read_text() for p in pages]
    return [
        cmd for text in texts for cmd in re.findall(rf"-m {re.escape(module)}\b([^\n]*)", text.replace("\\\n", " "))
    ]


def shown_overrides(module: str) -> list[str]:
    """The overrides of every `python -m <module>` command the README, docs/ and the experiment bundles show."""
    return [t for cmd in shown_commands(module) for t in cmd.split() if "=" in t and not t.startswith("-")]


def test_every_shown_command_passes_the_key_check():
    from experiments.runner.cli_checks import check_override_keys

    run_overrides = shown_overrides("experiments.run")
    assert {"+experiment=fig2_breakdown", "+ablation=base,t,tg,tgp"} <= set(run_overrides)
    check_override_keys(run_overrides)
    profile_overrides = shown_overrides("experiments.producers.profile")
    assert any(o.startswith("+profile_out=") for o in profile_overrides)
    check_override_keys(profile_overrides, extra=("profile_out",))
    check_override_keys(
        [
            "hydra.verbose=true",
            "hydra/launcher=basic",
            "~trace_dir",
            "++seqlen=1k",
            "hydra.sweeper.params.seqlen=1k",
            "model.path=/x",
            "system@other=clo",
        ]
    )


@pytest.mark.parametrize(
    "override,extra,words",
    [
        ("+sytem=clo", (), ["'sytem'", "did you mean system?", "seqlen", "experiment"]),
        ("sytem=clo", (), ["'sytem'"]),
        ("~sytem", (), ["'sytem'"]),
        ("+profile_out=x.json", (), ["'profile_out'"]),  # experiments.run does not read it
        ("+system.etaa=0.5", (), ["system.etaa", "conf/system/*.yaml"]),
        ("+workload.gen_token=4", (), ["workload.gen_token", "conf/workload/*.yaml"]),
        ("+hardware.gpu_mem=4", (), ["hardware.gpu_mem", "conf/config.yaml"]),
    ],
)
def test_unknown_keys_are_refused(override, extra, words):
    from experiments.runner.cli_checks import check_override_keys

    with pytest.raises(ConfigError) as e:
        check_override_keys([override], extra)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_the_bundles_keys_are_top_level_keys():
    """A bundle (package _global_) may set a top-level key of its own; the key check admits it."""
    from omegaconf import OmegaConf

    from experiments.runner.cli_checks import top_level_keys

    keys, groups = top_level_keys()
    assert {"experiment", "ablation", "model", "system", "workload"} <= groups
    for path in (CONF / "experiment").glob("*.yaml"):
        assert set(OmegaConf.load(path)) - {"defaults"} <= keys | groups, path


# ---- numbers and switches -------------------------------------------------------------------------------------
def composed(*overrides: str):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize(
    "override,message",
    [
        ("batch=abc", "batch='abc': expected a whole number"),
        ("batch=0", "batch=0 must be at least 1"),
        ("batch=1.5", "batch=1.5: expected a whole number"),
        ("seed=x", "seed='x': expected a whole number"),
        ("seed=-1", "seed=-1 must be at least 0"),
        ("repeat=-1", "repeat=-1 must be at least 0"),
        ("seqlen=lots", "seqlen='lots'"),
        ("workload.gen_tokens=two", "workload.gen_tokens='two'"),
        ("workload.warmup_steps=-1", "workload.warmup_steps=-1 must be at least 0"),
        ("workload.needle_depth=1.5", "workload.needle_depth=1.5 must lie in [0, 1]"),
        ("hardware.gpu_mem_gb=lots", "hardware.gpu_mem_gb='lots': expected a number or null"),
        ("hardware.gpu_mem_gb=0", "hardware.gpu_mem_gb=0 must be above 0"),
        ("hardware.hbm_gb_s=fast", "hardware.hbm_gb_s='fast'"),
        ("hardware.gpu_mem_gb=true", "hardware.gpu_mem_gb=True: expected a number"),
        ("force=maybe", "force='maybe': expected true or false"),
        ("profile_phases=1", "profile_phases=1: expected true or false"),
        ("workload.stop_at_eos=no", "workload.stop_at_eos='no'"),
    ],
)
def test_bad_numbers_are_config_errors(override, message):
    from experiments.runner.run_settings import check_numbers

    with pytest.raises(ConfigError) as e:
        check_numbers(composed(override))
    assert message in str(e.value)


def test_good_numbers_pass():
    from experiments.runner.run_settings import check_numbers

    n = check_numbers(composed("seqlen=4k", "batch=2", "seed=3", "hardware.gpu_mem_gb=48", "batch=2.0"))
    assert (n.seqlen, n.batch, n.seed, n.gpu_mem_gb, n.hbm_gb_s) == (4096, 2, 3, 48.0, None)


# ---- run identity ---------------------------------------------------------------------------------------------
def identity(*overrides: str) -> list[str]:
    from experiments.runner.records import run_identity

    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    return run_identity(cfg, list(overrides), dict(cfg.hydra.runtime.choices))


def test_run_identity_is_the_resolved_values():
    from experiments.runner.records import record_path

    assert identity("seqlen=4096") == identity("seqlen=4k") == identity("seqlen=4K") == ["seqlen=4k"]
    assert identity("seqlen=7680") == identity("seqlen=7.5k") == ["seqlen=7680"]
    assert identity("system=clo", "system.eta=0.80") == identity("system.eta=0.8", "system=clo")
    assert identity("batch=2.0") == identity("batch=2") == ["batch=2"]
    assert identity("+experiment=clo_synthetic", "system=clo") == ["+experiment=clo_synthetic", "system=clo"]
    assert identity("seqlen=1k", "results_dir=/x", "force=true", "wandb.enabled=false") == ["seqlen=1k"]
    assert identity("seqlen=4k") != identity("seqlen=8k")
    assert identity("trace_dir=null") == ["trace_dir=null"]
    assert identity("repeat=1") != identity("repeat=2") != identity()  # repeats of a point: records of their own
    path = record_path(Path("r"), identity("model=llama3", "seqlen=131072"))
    assert path.parent.name.startswith("model=llama3,seqlen=128k-")


# ---- a system's ConfigError through hydra.utils.instantiate ---------------------------------------------------
def test_config_error_is_unwrapped_from_instantiate():
    from hydra.errors import InstantiationException

    from experiments.runner.execute import build_system
    from experiments.runner.records import config_error

    cfg = composed("system=clo", "system.eta=1.5")
    with pytest.raises(InstantiationException) as e:
        instantiate(cfg.system)
    assert isinstance(config_error(e.value), ConfigError) and "eta=1.5" in str(config_error(e.value))
    assert config_error(RuntimeError("x")) is None
    with pytest.raises(ConfigError, match=r"^system=clo: eta=1.5"):
        build_system(cfg.system, "clo")


def test_command_line_overrides_leave_hydras_flags_out():
    from experiments.runner.cli_checks import command_line_overrides

    argv = [
        "--multirun",
        "-sc",
        "install=bash",
        "--config-name",
        "config",
        "seqlen=1k",
        "+experiment=ablation",
        "~trace_dir",
        "--cfg",
        "job",
        "-p",
        "system",
        "system=clo,fullattn",
    ]
    assert command_line_overrides(argv) == ["seqlen=1k", "+experiment=ablation", "~trace_dir", "system=clo,fullattn"]


def test_the_table5_bundle_sweeps_cells_with_the_systems_fastest():
    """+experiment=tab5_accuracy: one job per (length, task, system), each job one cell that
    experiments.accuracy's settings accept."""
    from experiments.accuracy.__main__ import settings

    with initialize_config_dir(str(CONF), version_base="1.3"):
        sweep = compose("config", overrides=["+experiment=tab5_accuracy"], return_hydra_config=True)
        one = ["+experiment=tab5_accuracy", "workload.lengths=4k", "workload.tasks=ruler_vt"]
        cell = compose("config", overrides=one)
    params = dict(sweep.hydra.sweeper.params)
    assert list(params) == ["workload.lengths", "workload.tasks", "system"]
    assert params["system"] == "fullattn,clo,retroinfer,infinigen" and len(params["workload.tasks"].split(",")) == 6
    assert settings(cell) == (["ruler_vt"], [4096], 40)


def test_the_table5_ablation_bundle_sweeps_clo_variants_on_the_table_samples():
    """+experiment=tab5_ablation: CLO only, each +clo_ablation variant one switch, the table's 20 samples."""
    from experiments.accuracy.__main__ import settings

    with initialize_config_dir(str(CONF), version_base="1.3"):
        sweep = compose("config", overrides=["+experiment=tab5_ablation"], return_hydra_config=True)
        cells = {
            v: compose("config", overrides=["+experiment=tab5_ablation", "workload.lengths=2k", f"+clo_ablation={v}"])
            for v in sweep.hydra.sweeper.params["+clo_ablation"].split(",")
        }
    assert len(cells) == 7 and all(c.system._target_ == "clo.system.CLO" for c in cells.values())
    assert cells["learned"].system.hash_weights and cells["simhash"].system.hash_weights is None
    assert cells["exact"].system.retriever == "exact" and cells["eta0.6"].system.eta == 0.6
    assert cells["nocache"].system.threshold_override == 2.0
    assert settings(cells["eta0.9"])[1:] == ([2048], 20)


def test_the_beyond_bundle_is_figure_10s_settings_on_its_own_grid():
    """+experiment=fig10_beyond: batches of 128 and 256 at 1K-4K, everything else as +experiment=fig10_throughput."""
    with initialize_config_dir(str(CONF), version_base="1.3"):
        beyond = compose("config", overrides=["+experiment=fig10_beyond"], return_hydra_config=True)
        fig10 = compose("config", overrides=["+experiment=fig10_throughput"], return_hydra_config=True)
    assert dict(beyond.hydra.sweeper.params) == {
        "seqlen": "1k,2k,4k",
        "batch": "128,256",
        "system": "fullattn,clo,retroinfer,infinigen",
    }
    for key in ("hardware", "model", "workload", "job_process", "decode_mode", "profile_phases"):
        assert beyond[key] == fig10[key], key


# ---- a run command's group options and jobs, checked before the first job ---------------------------------------
@pytest.mark.parametrize(
    "argv,words",
    [
        (["system=cl0"], ["system='cl0'", "did you mean clo?", "pqcache, retroinfer"]),
        (["--multirun", "system=clo,cl0"], ["system='cl0' in 'system=clo,cl0'"]),
        (["model=smolm2"], ["did you mean smollm2?"]),
        (["--multirun", "seqlen=1k,abc"], ["seqlen='abc'", "(job 2 of 2: seqlen=abc)"]),
        (
            ["--multirun", "batch=2,0", "seqlen=1k,2k"],
            ["batch=0 must be at least 1", "(job 3 of 4: batch=0 seqlen=1k)"],
        ),
        (["system.eta=0.5"], ["system.eta: this run's system (its default) has no setting 'eta'; clo has it"]),
        (["system=retroinfer", "system.topk_x=1"], ["system=retroinfer has no setting 'topk_x'; no system config"]),
        (["workload=accuracy"], ["python -m experiments.accuracy"]),
        (  # the bundle fills the KV by its key process: real SmolLM2 weights prefill instead, in every job
            ["--multirun", "+experiment=fig10_throughput", "model=smollm2", "seqlen=1k"],
            ["workload.kv_fill=key_process is for synthetic weights", "(job 1 of 28"],
        ),
        (
            ["workload.kv_fill=key_process", "model.weights=synthetic", "model.synthetic_keys=null"],
            ["no synthetic_keys"],
        ),
        (["system=retroinfer", "system.sink=abc"], ["system.sink='abc': expected an integer (RetroInfer's sink)"]),
        (["system=clo", "system.eta=x"], ["system.eta='x': expected a number (CLO's eta)"]),  # via its CLOConfig
        (["system=clo", "system.hash_weights=3"], ["expected a string or null"]),
        (["--multirun", "system=infinigen", "system.oracle_query=true,2"], ["expected true or false", "job 2 of 2"]),
        (["system=clo", "system.etaa=0.5"], ["system=clo has no setting 'etaa'", "(did you mean eta?)"]),
        (
            ["--multirun", "system=clo,retroinfer", "system.sink=32"],  # Hydra composes the sweep with fullattn
            ["before it sweeps system=clo,retroinfer", "write ++system.sink=32 to set it in each job"],
        ),
    ],
)
def test_a_run_command_is_refused_before_its_first_job(argv, words, capsys):
    from experiments.runner.cli_checks import refuse_unknown_keys

    with pytest.raises(SystemExit) as e:
        refuse_unknown_keys(argv, jobs=True)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert all(w in err for w in words), err


@pytest.mark.slow
def test_the_jobs_checked_are_the_sweeps_jobs():
    """A bundle's sweeper params crossed with the command line's (whose value of a key wins), as Hydra's basic
    sweeper runs them; what does not fit (a length beyond the model's context) is the job's to record."""
    from experiments.runner.cli_checks import check_jobs, refuse_unknown_keys

    assert len(check_jobs(["--multirun", "+experiment=fig10_throughput", "seqlen=8k"])) == 7 * 4
    assert len(check_jobs(["--multirun", "+experiment=fig10_throughput", "seqlen=8k", "system=clo,fullattn"])) == 7 * 2
    assert [n.seqlen for n in check_jobs(["model=smollm2", "seqlen=1m"])] == [2**20]
    refuse_unknown_keys(["--config-dir=/elsewhere", "+experiment=mine"], jobs=True)  # its options: Hydra's to find


@pytest.mark.slow
def test_every_shown_run_command_passes_the_job_check():
    """The README's, docs/' and the bundles' `python -m experiments.run` commands are not refused by the check that runs
    before their first job (a placeholder such as <p> is Hydra's to refuse)."""
    import shlex

    from experiments.runner.cli_checks import check_jobs

    commands = [shlex.split(cmd.split("#")[0].split("`")[0]) for cmd in shown_commands("experiments.run")]
    assert len(commands) >= 20
    assert sum(len(check_jobs(argv)) for argv in commands) > len(commands)  # the sweeps' jobs counted


def test_a_system_target_the_type_check_cannot_read_is_left_to_the_job():
    """A _target_ that does not import is the job's to meet and record, not a crash of the whole command."""
    check_system_settings({"_target_": "baselines.nowhere.Nothing", "sink": "abc"})


def test_a_yaml_boolean_given_for_a_string_setting_says_to_quote_it():
    with pytest.raises(ConfigError, match=r"system.graphs=True: expected a string .*one of its words, quoted"):
        check_system_settings({"_target_": "baselines.retroinfer.RetroInfer", "graphs": True})
