"""Load run records (record.json / record_*.json) under a folder into flat rows for plotting."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_records(root: Path, status: str = "ok") -> list[dict[str, Any]]:
    rows = []
    for path in sorted(root.rglob("record*.json")):
        rec = json.loads(path.read_text())
        if rec.get("status") != status:
            continue
        cfg = rec["config"]
        rows.append(
            {
                "path": str(path),
                "label": f"{rec['system']}\n{rec['model']} {cfg['seqlen']} b{rec['batch']} "
                f"{rec.get('decode_mode', 'eager')}",
                "record": rec,
            }
        )
    return rows


def stacked_phases(ax, x: list, values: dict[str, list[float]]) -> list[float]:
    """One stacked bar per x, one segment per phase (in the timer's order); returns the bar totals."""
    bottom = [0.0] * len(x)
    for phase, vals in values.items():
        ax.bar(x, vals, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, vals)]
    return bottom


def save(fig, out: Path) -> None:
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
