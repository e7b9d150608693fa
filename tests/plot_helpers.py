"""Small fake records in the producers' format, and the checks the plot tests share (tests/test_plots.py,
test_plots_fig10.py, test_plots_tables.py, test_report.py): a run record, folders of them for Figures 2 and 10,
a command's one-line refusal, and the figures a module draws kept open."""

import json
from pathlib import Path

import pytest

from kvoffload.kv.timer import PHASES
from plots.records import cli

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"


def run_record(system="clo", commit="abc1234", ms=10.0, **extra) -> dict:
    """A finished run record with the fields the plots read (experiments/runner/records.py writes many more)."""
    phases = {p: ms / len(PHASES) for p in PHASES} | {"total": ms}
    rec = {
        "status": "ok",
        "system": system,
        "model": "llama3",
        "seqlen": 131072,
        "batch": 1,
        "decode_mode": "piecewise",
        "phases_timed": True,
        "config": {
            "seqlen": "128k",
            "model": {"num_layers": 32},
            "system": {"adaptive_threshold": True, "gqa_aggregation": "mean", "persistent": True},
            "workload": {"needle_depth": 0.5},
        },
        "metrics": {
            "decode_ms_per_step": ms,
            "phase_ms_per_step": phases,
            "hit_rate": 0.8 if system in ("clo", "retroinfer") else None,
            "bytes_h2d_per_step": 1e8,
            "dense_floor_ms_per_step": 5.0,
            "decode_tokens_per_s": 1000 / ms,
            "prefill_tokens_per_s": 5000.0,
        },
        "system_state": {"plan": {"persistent_heads": 3, "prefetch_heads": 1}},
        "environment": {"device": "cuda", "git": {"commit": commit, "dirty": False}},
    }
    for key, value in extra.items():  # "config.system.persistent": False sets a nested field
        *path, last = key.split(".")
        node = rec
        for p in path:
            node = node[p]
        node[last] = value
    return rec


def write(folder: Path, records: dict[str, dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, rec in records.items():
        (folder / name).write_text(json.dumps(rec))
    return folder


def fig2_folder(folder: Path, commit="abc1234") -> Path:
    return write(
        folder,
        {
            f"record_{s}.json": run_record(s, commit, ms)
            for s, ms in (("fullattn", 10.0), ("clo", 9.0), ("retroinfer", 100.0), ("infinigen", 130.0))
        },
    )


def refused(fn, capsys) -> str:
    """fn run as a command: exit status 2 and one `error:` line on stderr, returned."""
    with pytest.raises(SystemExit) as e:
        cli(fn)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def drawn(module, monkeypatch) -> list:
    """The figures `module` draws, kept open instead of saved (to read their axes, legends and labels)."""
    figs = []
    monkeypatch.setattr(module, "save", lambda fig, out: figs.append(fig))
    return figs


def fig10_folder(folder: Path) -> Path:
    """Figure 10's runs at 128K, BSZ 1 and 4, of four systems; refusals for the device budget and the host's RAM,
    and a length (768K) where every run was refused."""
    recs = {}
    for s, tps in (("clo", 120.0), ("retroinfer", 100.0), ("infinigen", 80.0), ("fullattn", 150.0)):
        for b in (1, 4):
            rec = run_record(s, batch=b)
            rec["metrics"]["decode_tokens_per_s"] = tps * b
            rec["metrics"]["decode_ms_per_step"] = 1000 * b / rec["metrics"]["decode_tokens_per_s"]
            if s != "fullattn":
                rec["metrics"] |= {"system_floor_ms_per_step": 4.0, "hit_rate_with_refreshes": 0.5, "kv_device_gb": 2.0}
            if b == 1:  # four steps measured after one that is not; RetroInfer-style's slow step moves only its mean
                totals = {"clo": [99, 8, 8, 8, 8], "retroinfer": [99, 10, 10, 10, 40]}.get(s, [99, 12, 12, 12, 12])
                rec["metrics"]["decode_steps_measured"] = 4
                rec["steps"] = [{"phase_ms": {"total": float(t)}} for t in totals]
            recs[f"{s}_{b}/record.json"] = rec
    recs["fullattn_16/record.json"] = {  # the preflight's refusal, as experiments.run records it
        "status": "failed",
        "error_kind": "config",
        "error": "system=fullattn model=llama3 seqlen=128k batch=16 needs about 300.0 GB of GPU memory",
        "overrides": ["system=fullattn", "seqlen=128k", "batch=16", "+experiment=fig10_throughput"],
    }
    recs["clo_64/record.json"] = {  # refused for the host's RAM, not the device budget
        "status": "failed",
        "error_kind": "config",
        "error": "system=clo model=llama3 seqlen=128k batch=64 needs about 1100.0 GB of RAM on this host (weights 15)",
        "overrides": ["system=clo", "seqlen=128k", "batch=64", "+experiment=fig10_throughput"],
    }
    recs["fullattn_768k/record.json"] = {  # a length where every run was refused still gets its panel
        "status": "failed",
        "error_kind": "config",
        "error": "system=fullattn model=llama3 seqlen=768k batch=1 needs about 124.4 GB of GPU memory",
        "overrides": ["system=fullattn", "seqlen=768k", "batch=1", "+experiment=fig10_throughput"],
    }
    for name in recs:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
    return write(folder, recs)
