"""Paper Figure 2: per-layer decode latency by phase for each system, as a fraction of FullAttn's per-layer
latency in the same setting (the paper's "ideal"). Reads the records of `+experiment=fig2_breakdown`; where a
system has several (decode modes), its fastest. A graph-replayed step has no phases: its bar is all 'other'.

    python -m plots.fig2_breakdown results/runs --out plots/fig2_breakdown.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvoffload.kv.timer import PHASES  # noqa: E402
from plots.records import load_records, save, stacked_phases  # noqa: E402


def per_layer(rec: dict) -> dict[str, float]:
    layers = rec["config"]["model"]["num_layers"]
    return {p: rec["metrics"]["phase_ms_per_step"][p] / layers for p in PHASES}


def plot(root: Path, out: Path) -> dict[str, dict[str, float]]:
    fastest: dict[str, dict] = {}
    for r in (x["record"] for x in load_records(root)):
        best = fastest.get(r["system"])
        if best is None or r["metrics"]["decode_ms_per_step"] < best["metrics"]["decode_ms_per_step"]:
            fastest[r["system"]] = r
    by_system = {name: per_layer(fastest[name]) for name in sorted(fastest)}
    if "fullattn" not in by_system or len(by_system) < 2:
        raise SystemExit(f"need records of fullattn and at least one other system under {root}")
    ideal = sum(by_system["fullattn"].values())
    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(by_system)
    labels = [f"{n}\n({fastest[n].get('decode_mode', 'eager')})" for n in names]
    totals = stacked_phases(ax, labels, {p: [by_system[n][p] / ideal * 100 for n in names] for p in PHASES})
    for i, total in enumerate(totals):
        ax.text(i, total, f"{total:.0f}%", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("per-layer decode latency, % of FullAttn")
    ax.legend(fontsize=7)
    save(fig, out)
    return {
        n: {
            **v,
            "percent_of_fullattn": sum(v.values()) / ideal * 100,
            "decode_mode": fastest[n].get("decode_mode", "eager"),
        }
        for n, v in by_system.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    for name, row in plot(args.root, args.out).items():
        print(f"{name:<12} {row['percent_of_fullattn']:6.0f}% of FullAttn per layer")


if __name__ == "__main__":
    main()
