"""Per-step decode time by phase (the shared PhaseTimer's names), one stacked bar per run, next to the run's
dense memory floor. Graph-replayed runs have no per-phase timing: their bar is all 'other'. Records of several
commits are refused unless --allow-mixed-commits (plots.all's caption names each file's commit).

    python -m plots.phase_breakdown results/gpu_smoke_llama3/eager --out phases.png
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from plots.records import cli, load_records, phases_of, plot_arguments, save, stacked_phases  # noqa: E402


def plot(root: Path, out: Path, allow_mixed: bool = False) -> int:
    rows = load_records(root, allow_mixed=allow_mixed)
    phases = phases_of(rows)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4.5))
    x = list(range(len(rows)))
    stacked_phases(ax, x, {p: [r["record"]["metrics"]["phase_ms_per_step"][p] for r in rows] for p in phases})
    floors = [r["record"]["metrics"]["dense_floor_ms_per_step"] for r in rows]
    ax.scatter(x, floors, marker="_", s=900, color="black", zorder=3, label="dense memory floor")
    ax.set_xticks(x, bar_labels(rows), fontsize=7)
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"Decode step by phase: {rows.root.name}", fontsize=9)
    ax.legend(fontsize=7)
    save(fig, out)
    return len(rows)


def bar_labels(rows) -> list[str]:
    """Each run's system, model, length, batch and mode; where two runs share those (they differ in a setting the
    label leaves out, or in their commit: plots.all's caption names each file's), its file's name under it."""
    labels = [r["label"] for r in rows]
    if len(set(labels)) < len(labels):
        labels = [f"{label}\n{Path(r['file']).stem.removeprefix('record_')}" for label, r in zip(labels, rows)]
    return labels


def main() -> None:
    ap = plot_arguments(__doc__, mixed=True)
    args = ap.parse_args()
    print(f"{plot(args.root, args.out, args.allow_mixed_commits)} runs -> {args.out}")


if __name__ == "__main__":
    cli(main)
