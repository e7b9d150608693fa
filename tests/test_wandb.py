"""W&B logging as its users expect: a real offline run read back from its files (group, job type, flat config,
summary, the phase table), the run command's plumbing of the bundle name, every bundle logging by default, and a
W&B failure that leaves the run done. The W&B Report of a comparison is built offline and checked panel by panel."""

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from experiments.runner.wandb_log import log_wandb, resolve_mode, run_config, run_group

ROOT = Path(__file__).resolve().parent.parent
PHASES = {"retrieval": 0.1, "cache_mgmt": 0.2, "transfer_exposed": 0.3, "attention": 1.5, "launch_sync": 0.0}


def record(system: str = "clo") -> dict:
    """The parts of a run record (experiments/runner/execute.py, step_metrics.py) that log_wandb reads."""
    phases = {**PHASES, "other": 2.0, "total": 4.1}
    return {
        "config": {
            "model": {"name": "smollm2", "weights": "synthetic", "head_dim": 64},
            "system": {"_target_": "clo.system.CLO", "eta": 0.8, "persistent": True},
            "workload": {"prompt": "random", "gen_tokens": 4},
            "seqlen": "4k",
            "batch": 1,
            "decode_mode": "auto",
            "results_dir": "/somewhere",
            "force": False,
            "wandb": {"enabled": True},
        },
        "system": system,
        "model": "smollm2",
        "seqlen": 4096,
        "batch": 1,
        "decode_mode": "eager",
        "weights": "synthetic (seed 0)",
        "environment": {"device": "cpu", "git": {"commit": "abc123"}},
        "metrics": {
            "decode_ms_per_step": 4.1,
            "hit_rate": 0.8,
            "decode_tokens_per_s": 243.9,
            "phase_ms_per_step": phases,
        },
        "steps": [{"phase_ms": phases} for _ in range(3)],
    }


def wandb_cfg(tmp: Path, **kw):
    return OmegaConf.create(
        {"project": "test", "entity": None, "group": None, "mode": "offline", "dir": str(tmp), **kw}
    )


# ---- reading an offline run back: the .wandb file is a LevelDB-style log of protobuf records ------------------
BLOCK, HEADER = 32768, 7  # a 7-byte file header (":W&B", magic, version), then 7-byte chunk headers in 32 KiB blocks


def wandb_records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, parts = HEADER, []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if left < HEADER or (n == 0 and kind == 0):  # the block's zero padding
            pos += left
            continue
        if pos + HEADER + n > len(data):  # a chunk still being written
            return
        parts.append(data[pos + HEADER : pos + HEADER + n])
        pos += HEADER + n
        if kind in (1, 4):  # a full record, or a record's last chunk
            r = pb.Record()
            r.ParseFromString(b"".join(parts))
            parts = []
            yield r


def offline_run(wandb_dir: Path) -> dict:
    """What one offline run under wandb_dir logged: {run: {group, job_type, name, project}, config, summary}."""
    (run_dir,) = (wandb_dir / "wandb").glob("offline-run-*")
    (log,) = run_dir.glob("run-*.wandb")
    # wandb-core writes the file from its own process and may still be writing when run.finish() returns: wait
    # for the run's last record (its exit).
    deadline = time.monotonic() + 10
    while not any(r.WhichOneof("record_type") == "exit" for r in wandb_records(log)):
        assert time.monotonic() < deadline, f"{log} has no exit record after 10 s"
        time.sleep(0.1)
    out = {"config": {}, "summary": {}, "dir": run_dir}
    for r in wandb_records(log):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out["run"] = {
                "group": r.run.run_group,
                "job_type": r.run.job_type,
                "name": r.run.display_name,
                "project": r.run.project,
            }
            out["config"].update({i.key: json.loads(i.value_json) for i in r.run.config.update})
        elif kind == "summary":
            out["summary"].update({i.key: json.loads(i.value_json) for i in r.summary.update if i.key})
    return out


@pytest.mark.slow
def test_a_run_logs_offline_with_group_job_type_flat_config_summary_and_phase_table(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = OmegaConf.create({"wandb": wandb_cfg(tmp_path, mode="auto")})  # auto, without a key: offline
    choices = {"experiment": "fig2_breakdown", "system": "clo", "workload": "decode", "model": "smollm2"}
    assert log_wandb(cfg, record(), "seqlen=4k-1234", choices) is True
    got = offline_run(tmp_path)
    assert (
        f"[wandb] logged offline to {got['dir']} (upload it with `wandb sync {got['dir']}`)" in capsys.readouterr().err
    )
    assert got["run"] == {"group": "fig2_breakdown", "job_type": "clo", "name": "seqlen=4k-1234", "project": "test"}
    c = got["config"]
    assert (c["system"], c["model"], c["seqlen"], c["batch"], c["workload"]) == ("clo", "smollm2", 4096, 1, "decode")
    assert (c["system.eta"], c["system.persistent"], c["workload.prompt"], c["model.head_dim"]) == (
        0.8,
        True,
        "random",
        64,
    )
    assert c["experiment"] == "fig2_breakdown" and c["decode_mode"] == "eager" and c["commit"] == "abc123"
    assert not {"system._target_", "results_dir", "force", "wandb.enabled"} & set(c)
    s = got["summary"]
    assert s["decode_ms_per_step"] == 4.1 and s["hit_rate"] == 0.8  # the record's means, not the last step's
    assert s["phase_ms/attention"] == 1.5 and s["phase_ms/total"] == 4.1
    (table,) = (got["dir"] / "files" / "media" / "table").glob("phase_breakdown*.table.json")
    t = json.loads(table.read_text())
    assert t["columns"] == ["system", "phase", "ms_per_step"]
    assert {row[1]: row[2] for row in t["data"]} == {**PHASES, "other": 2.0} and {row[0] for row in t["data"]} == {
        "clo"
    }


@pytest.mark.slow
def test_committed_records_are_logged_after_the_fact_grouped_by_their_folder(tmp_path, monkeypatch, capsys):
    """The GPU machine runs without wandb: experiments.tracking.wandb_records logs a results folder's decode records as
    experiments.run would have, the folder's name as the group; refusals are skipped, an empty folder refused."""
    from experiments.tracking.wandb_records import main

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    folder = tmp_path / "fig_x"
    folder.mkdir()
    ok = {**record(), "status": "ok", "overrides": ["system=clo", "+experiment=fig2_breakdown"]}
    (folder / "record_clo.json").write_text(json.dumps(ok))
    refusal = {"status": "failed", "error_kind": "config", "error": "needs about 80 GB", "overrides": ["system=x"]}
    (folder / "record_fullattn.json").write_text(json.dumps(refusal))
    assert main([str(folder), "--mode", "offline", "--dir", str(tmp_path / "w"), "--project", "test"]) == 0
    assert "1 of 1 records logged to group 'fig_x' (1 skipped" in capsys.readouterr().out
    got = offline_run(tmp_path / "w")
    assert got["run"] == {"group": "fig_x", "job_type": "clo", "name": "record_clo", "project": "test"}
    assert got["config"]["experiment"] == "fig2_breakdown" and got["summary"]["decode_ms_per_step"] == 4.1
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert "no finished decode records" in capsys.readouterr().err


def test_group_is_the_setting_else_the_bundle_else_model_and_workload(tmp_path):
    rec = record()
    assert run_group(wandb_cfg(tmp_path, group="mine"), rec, {"experiment": "ablation"}) == "mine"
    assert run_group(wandb_cfg(tmp_path), rec, {"experiment": "ablation", "workload": "decode"}) == "ablation"
    assert run_group(wandb_cfg(tmp_path), rec, {"workload": "decode"}) == "smollm2-decode"


def test_every_sweep_axis_is_a_flat_config_key():
    c = run_config(record(), {"workload": "decode", "ablation": "tg"})
    assert c["ablation"] == "tg" and c["experiment"] is None
    assert all(not isinstance(v, dict) for v in c.values())


def test_mode_auto_is_online_only_with_an_api_key(monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert resolve_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_mode("auto") == "online" and resolve_mode("disabled") == "disabled"


class FakeRun:
    """What _log touches of a wandb Run, with the folder and page a real one has."""

    def __init__(self, tmp: Path) -> None:
        self.dir, self.url, self.summary = str(tmp / "wandb" / "offline-run-x" / "files"), "https://wandb.ai/u/p/r", {}

    def log(self, *args, **kwargs) -> None:
        pass

    def finish(self) -> None:
        pass


@pytest.mark.parametrize(
    "mode,where",
    [
        (
            "offline",
            "logged offline to {tmp}/wandb/offline-run-x (upload it with `wandb sync {tmp}/wandb/offline-run-x`)",
        ),
        ("online", "logged to https://wandb.ai/u/p/r"),
        ("disabled", "not logged: wandb.mode=disabled"),
    ],
)
def test_a_logged_run_says_where_it_went(tmp_path, monkeypatch, capsys, mode, where):
    import wandb

    monkeypatch.setattr(wandb, "init", lambda **kwargs: FakeRun(tmp_path))
    assert log_wandb(OmegaConf.create({"wandb": wandb_cfg(tmp_path, mode=mode)}), record(), "x", {}) is True
    assert capsys.readouterr().err == f"[wandb] {where.format(tmp=tmp_path)}\n"


def test_a_wandb_failure_is_a_warning_not_a_failed_run(tmp_path, monkeypatch, capsys):
    import wandb

    def broken(**kwargs):
        raise wandb.errors.CommError("could not reach the server\nretrying")

    monkeypatch.setattr(wandb, "init", broken)
    cfg = OmegaConf.create({"wandb": wandb_cfg(tmp_path)})
    assert log_wandb(cfg, record(), "x", {}) is False
    err = capsys.readouterr().err.strip()
    assert err.startswith("[wandb] warning: not logged (CommError: could not reach the server; retrying)")
    assert "\n" not in err
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed (a GPU machine without it)
    assert log_wandb(cfg, record(), "x", {}) is False
    assert "ModuleNotFoundError" in capsys.readouterr().err


def test_every_experiment_bundle_logs_to_wandb():
    from hydra import compose, initialize_config_dir

    bundles = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
    assert "fig2_breakdown" in bundles
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for b in bundles:
            assert compose("config", overrides=[f"+experiment={b}"]).wandb.enabled is True, b


@pytest.mark.slow
def test_the_run_command_logs_its_bundle_as_the_group(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "WANDB_API_KEY"}
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.run",
            "+experiment=clo_synthetic",
            "model=smollm2",
            "seqlen=64",
            "workload.gen_tokens=3",
            f"results_dir={tmp_path / 'results'}",
            f"hydra.run.dir={tmp_path / 'out'}",
            f"wandb.dir={tmp_path}",
        ],
        cwd=ROOT,
        env={**env, "WANDB_SILENT": "true"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    got = offline_run(tmp_path)
    assert got["run"]["group"] == "clo_synthetic" and got["run"]["job_type"] == "fullattn"
    assert got["config"]["workload.prompt"] == "random" and got["summary"]["decode_ms_per_step"] > 0


# ---- the W&B Report of a comparison ------------------------------------------------------------------------------
def test_the_report_compares_a_groups_systems_in_its_panels():
    wr = pytest.importorskip(
        "wandb_workspaces.reports.v2", reason="wandb-workspaces is not installed (pip install -e '.[report]')"
    )
    from experiments.tracking.wandb_report import build_report
    from kvoffload.kv.timer import PHASES

    report = build_report("clo-kv-offload", "fig2_breakdown", entity="someone")
    assert (report.project, report.entity) == ("clo-kv-offload", "someone") and "fig2_breakdown" in report.title
    (grid,) = [b for b in report.blocks if isinstance(b, wr.PanelGrid)]
    (runs,) = grid.runsets
    assert (runs.project, runs.entity) == ("clo-kv-offload", "someone")
    assert str(runs.filters) == "Metric(\"Group\") == 'fig2_breakdown'"
    bars = {p.title: p for p in grid.panels if isinstance(p, wr.BarPlot)}
    by_metrics = {tuple(m.name for m in p.metrics): p for p in bars.values()}
    assert set(by_metrics) == {("decode_ms_per_step",), tuple(f"phase_ms/{p}" for p in PHASES), ("hit_rate",)}
    # What the server reads (a panel's spec needs no server, unlike the runset's): summary keys, grouped by the
    # config key `system` that wandb_log writes.
    for panel in bars.values():
        spec = panel._to_model().config
        assert spec.group_by == "system.value" and all(m.startswith("summary_metrics.") for m in spec.metrics)
    (table,) = [p for p in grid.panels if isinstance(p, wr.WeavePanelSummaryTable)]
    assert table.table_name == "phase_breakdown"  # the table wandb_log logs


def test_the_report_command_without_an_api_key_says_so_and_exits_2(monkeypatch, capsys):
    from experiments.tracking.wandb_report import main

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert main(["--project", "p", "--group", "g"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: saving a W&B report needs WANDB_API_KEY") and err.count("\n") == 1
