"""Per-step decode time by phase (the shared PhaseTimer's names), one stacked bar per run, next to the run's
dense memory floor. Graph-replayed runs have no per-phase timing: their bar is all 'other'.

    python -m plots.phase_breakdown results/gpu_smoke_llama3 --out plots/phase_breakdown.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvoffload.kv.timer import PHASES  # noqa: E402
from plots.records import load_records, save, stacked_phases  # noqa: E402


def plot(root: Path, out: Path) -> int:
    rows = load_records(root)
    if not rows:
        raise SystemExit(f"no finished run records under {root}")
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(rows)), 4.5))
    x = list(range(len(rows)))
    stacked_phases(ax, x, {p: [r["record"]["metrics"]["phase_ms_per_step"][p] for r in rows] for p in PHASES})
    floors = [r["record"]["metrics"]["dense_floor_ms_per_step"] for r in rows]
    ax.scatter(x, floors, marker="_", s=900, color="black", zorder=3, label="dense memory floor")
    ax.set_xticks(x, [r["label"] for r in rows], fontsize=7)
    ax.set_ylabel("ms per decode step")
    ax.legend(fontsize=7)
    save(fig, out)
    return len(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    print(f"{plot(args.root, args.out)} runs -> {args.out}")


if __name__ == "__main__":
    main()
