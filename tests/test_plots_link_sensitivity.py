"""The link-sensitivity figure (plots.link_sensitivity) over the committed capped-link records: its table quotes
the records' throughput, CLO's plan and its lead, and a folder of two device budgets is refused."""

import json
import shutil

import pytest

from plots import link_sensitivity
from plots.records import RecordError
from tests.plot_helpers import RESULTS, drawn

CAPPED = RESULTS / "investigations" / "link_cap_fig10_h100"


def test_the_table_quotes_each_link_and_clo_s_plan():
    table = link_sensitivity.table(CAPPED)
    clo = json.loads((CAPPED / "record_clo_128k_b1_cap21.21.json").read_text())
    retro = json.loads((CAPPED / "record_retroinfer_128k_b1_cap21.21.json").read_text())
    plan = clo["system_state"]["plan"]
    lead = clo["metrics"]["decode_tokens_per_s"] / retro["metrics"]["decode_tokens_per_s"]
    row = next(line for line in table.splitlines() if line.startswith("| 21.21 |"))
    assert f"{clo['metrics']['decode_tokens_per_s']:.1f} ({clo['metrics']['step_over_system_floor']:.2f})" in row
    assert f"| {plan['prefetch_heads']} / {plan['persistent_heads']} |" in row
    assert row.endswith(f"| {lead:.2f}x (RetroInfer-style) |")
    assert "| native (" in table and "**32K BSZ 8**" in table


def test_the_figure_draws_a_column_a_point(monkeypatch):
    figs = drawn(link_sensitivity, monkeypatch)
    d = link_sensitivity.plot(CAPPED, "unused")
    assert len(figs) == 1 and len(figs[0].axes) == 2 * len(d["points"]) == 4


def test_two_device_budgets_are_refused(tmp_path):
    shutil.copytree(CAPPED, tmp_path / "runs")
    path = tmp_path / "runs" / "record_clo_32k_b8_native.json"
    rec = json.loads(path.read_text())
    rec["config"]["hardware"]["gpu_mem_gb"] = None
    path.write_text(json.dumps(rec))
    with pytest.raises(RecordError, match="several device budgets"):
        link_sensitivity.data(tmp_path / "runs")
