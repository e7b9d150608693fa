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
        rows.append({
            "path": str(path),
            "label": f"{rec['system']}\n{rec['model']} {cfg['seqlen']} b{rec['batch']} {rec.get('decode_mode', 'eager')}",
            "record": rec,
        })
    return rows
