"""Bad input a new user meets, refused up front by the run command: one `error:` line, exit status 2, nothing
written. These fail before any model loads, so they stay in the fast loop (a few seconds each: the imports)."""

import os
from pathlib import Path

import pytest

from experiments.runner.preflight import check_writable
from kvoffload.errors import ConfigError
from tests.test_run_command import FAST, run, single_error


def written(tmp: Path) -> list[Path]:
    """What a refused run left under tmp (the test's own inputs excepted): the results, Hydra's run folder."""
    return sorted(p for p in tmp.rglob("*") if p.name not in ("afile", "ro"))


@pytest.mark.parametrize("under", ["afile", "afile/runs"])
def test_results_dir_at_a_file_is_refused_before_the_run(tmp_path, under):
    """It used to fail after the whole run, in the record's write, with a NotADirectoryError traceback."""
    (tmp_path / "afile").write_text("not a folder")
    line = single_error(run(f"results_dir={tmp_path / under}", "seqlen=64", *FAST, tmp=tmp_path, check=False))
    assert f"results_dir={tmp_path / under}" in line and "is a file, not a folder" in line
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
    ro = tmp_path / "ro"
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
