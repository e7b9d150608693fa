"""Bad input a new user meets, refused up front by the run command: one `error:` line, exit status 2, nothing
written. These fail before any model loads, so they stay in the fast loop (a few seconds each: the imports)."""

import os
from pathlib import Path

import pytest

from experiments.runner.run_settings import check_writable
from kvoffload.errors import ConfigError
from tests.run_helpers import FAST, run, single_error


def given(tmp: Path) -> Path:
    """The folder of a test's own inputs (a file in results_dir's way, a checkpoint), which written() leaves out."""
    (tmp / "in").mkdir(exist_ok=True)
    return tmp / "in"


def written(tmp: Path) -> list[Path]:
    """What a refused run left under tmp: its results, Hydra's run folder, W&B's, anything."""
    return sorted(p for p in tmp.rglob("*") if p.relative_to(tmp).parts[0] != "in")


@pytest.mark.parametrize("under", ["afile", "afile/runs"])
def test_results_dir_at_a_file_is_refused_before_the_run(tmp_path, under):
    """It used to fail after the whole run, in the record's write, with a NotADirectoryError traceback."""
    (given(tmp_path) / "afile").write_text("not a folder")
    where = given(tmp_path) / under
    line = single_error(run(f"results_dir={where}", "seqlen=64", *FAST, tmp=tmp_path, check=False))
    assert f"results_dir={where}" in line and "is a file, not a folder" in line
    assert written(tmp_path) == []


def test_results_dir_nobody_can_write_is_refused(tmp_path):
    """/proc takes no new folder, even from root (where a chmod'ed folder would not stop it)."""
    if not Path("/proc/self").is_dir():
        pytest.skip("needs Linux's /proc")
    line = single_error(run("results_dir=/proc/clo-results", "seqlen=64", *FAST, tmp=tmp_path, check=False))
    assert "results_dir=/proc/clo-results: cannot write in /proc" in line
    assert written(tmp_path) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_results_dir_in_a_read_only_folder_is_refused(tmp_path):
    ro = given(tmp_path) / "ro"
    ro.mkdir(mode=0o555)
    line = single_error(run(f"results_dir={ro / 'runs'}", "seqlen=64", *FAST, tmp=tmp_path, check=False))
    assert f"cannot write in {ro}" in line and "Permission denied" in line
    assert written(tmp_path) == []


def test_check_writable_leaves_nothing_and_takes_what_it_would_create(tmp_path):
    check_writable(tmp_path / "new" / "runs", "results_dir")  # created later, by the run: fine
    check_writable(tmp_path / "trace.json", "memory_snapshot", folder=False)
    assert list(tmp_path.iterdir()) == []  # the probe folder is gone
    with pytest.raises(ConfigError, match="is a folder, not a file"):
        check_writable(tmp_path, "memory_snapshot", folder=False)
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    with pytest.raises(ConfigError, match="is a broken link"):
        check_writable(tmp_path / "link" / "runs", "trace_dir")


@pytest.mark.parametrize(
    "text,message",
    [
        ('{"hidden_size": 576', "config.json is not valid JSON (Expecting ',' delimiter"),
        ("{}", "config.json has no 'hidden_size', 'intermediate_size', 'num_hidden_layers'"),
        (
            '{"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "vocab_size": 49152}',
            "no 'num_attention_heads'",
        ),
        ("[1, 2]", "config.json holds a JSON list, not an object"),
    ],
)
def test_a_broken_checkpoint_config_is_one_line_naming_it(tmp_path, text, message):
    """It was a KeyError or JSONDecodeError traceback inside Hydra's "Error executing job" wrapper."""
    folder = given(tmp_path)
    (folder / "config.json").write_text(text)
    line = single_error(run(f"model.path={folder}", "seqlen=64", *FAST[1:], tmp=tmp_path, check=False))
    assert f"model.path={folder}: {folder / 'config.json'}" in line and message in line
    assert written(tmp_path) == []


def test_a_bad_wandb_mode_is_refused_before_the_run(tmp_path):
    """It was a warning after the whole run, which then went unlogged."""
    args = ("seqlen=64", *FAST[:-1], "wandb.enabled=true", "wandb.mode=bogus", f"wandb.dir={tmp_path}")
    line = single_error(run(*args, tmp=tmp_path, check=False))
    assert line == "error: wandb.mode='bogus'; valid: auto, online, offline, disabled"
    assert written(tmp_path) == []
