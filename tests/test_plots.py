"""Figures are made from records: the phase-breakdown plot reads the committed GPU smoke records."""

from pathlib import Path

from plots.phase_breakdown import plot

ROOT = Path(__file__).resolve().parent.parent


def test_phase_breakdown_from_committed_records(tmp_path):
    out = tmp_path / "phases.png"
    n = plot(ROOT / "results" / "gpu_smoke_llama3", out)
    assert n >= 4 and out.stat().st_size > 10_000
