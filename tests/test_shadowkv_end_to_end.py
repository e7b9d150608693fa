"""ShadowKV-style through the commands on the CPU: the run command on SmolLM2's needle prompt, the fidelity workload
with its selection probe, and bad settings refused as one `error:` line before any work."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.fidelity import documents as docs
from kvoffload.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
FAST = ["model.weights=synthetic", "workload.prompt=random", "workload.gen_tokens=2", "wandb.enabled=false"]


def command(module: str, *args: str, tmp: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_SILENT": "true", "HYDRA_FULL_ERROR": "0"}
    where = [f"results_dir={tmp / 'results'}"]
    if module == "experiments.run":
        where += [f"hydra.run.dir={tmp / 'out'}", "wandb.enabled=false"]
    return subprocess.run(
        [sys.executable, "-m", module, "system=shadowkv", *where, *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip


@pytest.mark.slow
def test_the_run_command_finds_the_needle_with_real_smollm2(tmp_path):
    """The default 3K needle prompt at the original's budget: 256 of 328 landmarks' chunks a step, most kept from the
    step before (rebuilt and fetched only the others)."""
    p = command("experiments.run", tmp=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    (path,) = (tmp_path / "results").glob("*/record.json")
    rec = json.loads(path.read_text())
    assert rec["status"] == "ok" and rec["answer"]["found"] is True, rec["answer"]
    m = rec["metrics"]
    assert m["hit_unit"] == "chunk" and 0 < m["hit_rate"] < 1 and m["bytes_h2d_per_step"] > 0
    assert m["phase_ms_per_step"]["cache_mgmt"] > 0 and m["system_floor_ms_per_step"] > 0
    state = rec["system_state"]
    assert state["geometry"]["select"] == 256 and state["geometry"]["outliers"] == 48
    assert state["memory_parts"]["host"] > 0 and state["memory_parts"]["low_rank"] > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (["system.rank=193"], "rank=193 exceeds the keys' 192 columns"),
        (["system.rank=0"], "rank=0"),
        (["system.budget=100"], "budget=100 must be a positive multiple of chunk_size=8"),
        (["system.topk_ratio=0.02"], "below the outliers and local window"),
        (["seqlen=7"], "a prompt of 7 tokens is shorter than one chunk"),
    ],
)
def test_bad_settings_are_one_error_line_before_any_work(tmp_path, args, message):
    p = command("experiments.run", "seqlen=1k", *FAST, *args, tmp=tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], p.stderr[-3000:]


@pytest.mark.slow
def test_the_fidelity_workload_probes_what_it_attended(tmp_path):
    """Two documents through the fidelity command at a budget below the prompt: it departs from exact attention,
    and the probe measures every layer (no dense layers) against the window the system says it attends whole."""
    try:
        docs.sources_dir("python-docs", None)
    except ConfigError as e:
        pytest.skip(str(e))
    p = command("experiments.fidelity", "system.topk_ratio=0.2", "workload.length=512", "workload.steps=8",
                "workload.documents=2", "workload.batch=2", tmp=tmp_path)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    (path,) = (tmp_path / "results").rglob("record.json")
    rec = json.loads(path.read_text())
    s = rec["summary"]
    assert s["kl"]["mean"] > 1e-4 and 0 < s["recall"]["mean"] <= 1 and 0 < s["mass"]["mean"] <= 1
    assert set(rec["per_layer"]) == {str(i) for i in range(30)}
    g = rec["system_state"]["geometry"]
    assert 0 < rec["hit_rate"] < 1 and (g["select"], g["outliers"]) == (4, 1)  # 32 and 8 tokens of 503, window 55
