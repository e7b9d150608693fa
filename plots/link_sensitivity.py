"""How the trade-offs move with the host link (`+experiment=link_sensitivity`): at each Figure 10 point of the
folder, every system's decode throughput against the link cap (hardware.link_gb_s; the real, unpaced link drawn at
the bulk rate its run measured), and CLO's plan beside it: Eq. 12's prefetch heads against its persistent heads.
One commit a folder: the curves are compared with each other.

    python -m plots.link_sensitivity results/link_sensitivity --out link_sensitivity
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from plots import fig10_throughput  # noqa: E402
from plots.markdown import md  # noqa: E402
from plots.records import SYSTEMS, RecordError, cli, load_records, paper_style, plot_arguments, save, tokens  # noqa: E402

NATIVE = "native"


link_of = fig10_throughput.link_cap_of  # the cap a run ran under (None: the real link, unpaced)


def link_order(cap: float | None) -> tuple:
    """Caps from the slowest, the real link last."""
    return (cap is None, cap or 0)


def x_of(rec: dict) -> float:
    """Where a run sits on the link axis: its cap, or for an unpaced run the bulk copy rate it measured."""
    return link_of(rec) or rec["link"]["bulk_unpaced_gb_s"]


def data(root: Path) -> dict:
    """{(seqlen, batch): {system: [record, ...] by link, the native run last}} of one commit and one budget."""
    recs = load_records(Path(root))
    budgets = {fig10_throughput.budget_of(r["record"]) for r in recs}
    if len(budgets) > 1:
        raise RecordError(f"records of several device budgets under {root} ({sorted(map(str, budgets))})")
    points: dict = {}
    for r in recs:
        rec = r["record"]
        by_system = points.setdefault((rec["seqlen"], rec["batch"]), {})
        by_system.setdefault(rec["system"], []).append(rec)
    for key, by_system in points.items():
        for runs in by_system.values():
            runs.sort(key=lambda rec: link_order(link_of(rec)))
        points[key] = {s: by_system[s] for s in SYSTEMS if s in by_system}
    return {"points": dict(sorted(points.items(), key=lambda p: (-p[0][0], p[0][1]))), "records": recs}


def plan(rec: dict) -> dict:
    return (rec.get("system_state") or {}).get("plan") or {}


def plot(root, out) -> dict:
    d = data(root)
    points = d["points"]
    with paper_style():
        fig, axes = plt.subplots(2, len(points), figsize=(3.4 * len(points), 5), squeeze=False, sharex="col")
        for col, ((seqlen, batch), by_system) in enumerate(points.items()):
            top, bottom = axes[0][col], axes[1][col]
            for system, runs in by_system.items():
                xs = [x_of(r) for r in runs]
                ys = [r["metrics"]["decode_tokens_per_s"] for r in runs]
                style = {"marker": "o", "color": fig10_throughput.colour(system), "label": SYSTEMS[system]}
                if len(runs) == 1:  # one run (FullAttn moves nothing): a line across, not a lone dot
                    top.axhline(ys[0], ls="--", lw=1, color=style["color"], label=style["label"])
                else:
                    top.plot(xs, ys, **style)
            top.set_title(f"{tokens(seqlen)} BSZ {batch}")
            top.set_ylabel("decode tokens/s")
            top.set_yscale("log")
            clo = by_system.get("clo", [])
            xs = [x_of(r) for r in clo]
            bottom.plot(xs, [plan(r).get("prefetch_heads", 0) for r in clo], marker="o", label="prefetch heads")
            bottom.plot(xs, [plan(r).get("persistent_heads", 0) for r in clo], marker="s", label="persistent heads")
            bottom.set_ylabel("CLO's heads (Eq. 12)")
            bottom.set_xlabel("host link (GB/s; last point: the real link, unpaced)")
        axes[0][0].legend(fontsize=7)
        axes[1][0].legend(fontsize=7)
        save(fig, out)
    return d


def table(root: Path, folder: str = "") -> str:
    """Per point and link: each system's tokens/s and its step over its own floor, CLO's plan and device KV, and
    CLO over the best offloading baseline that ran at that link."""
    d = data(root)
    out = []
    for (seqlen, batch), by_system in d["points"].items():
        systems = list(by_system)  # in SYSTEMS' order (data)
        seen = {link_of(r) for runs in by_system.values() for r in runs if len(runs) > 1}
        links = sorted(seen, key=link_order)
        rows = []
        for link in links:
            at = {s: next((r for r in runs if link_of(r) == link), None) for s, runs in by_system.items()}
            cells = [cell(at[s]) for s in systems]
            clo = at.get("clo")
            p = plan(clo) if clo else {}
            heads = f"{p['prefetch_heads']} / {p['persistent_heads']}" if p else "–"
            kv = f"{clo['metrics']['kv_device_gb']:.2f}" if clo else "–"
            any_run = clo or next(r for r in at.values() if r)
            name = f"{link:g}" if link else f"{NATIVE} ({x_of(any_run):.1f})"
            rows.append([name, *cells, heads, kv, lead(at)])
        head = ["link (GB/s)", *(SYSTEMS[s] for s in systems), "CLO prefetch / persistent heads"]
        head += ["CLO device KV (GB)", "CLO / best baseline"]
        out.append(f"**{tokens(seqlen)} BSZ {batch}**, tokens/s (step over its own floor):\n\n" + md(head, rows))
    return "\n\n".join(out)


def cell(rec: dict | None) -> str:
    if rec is None:
        return "–"
    m = rec["metrics"]
    over = m.get("step_over_system_floor")
    return f"{m['decode_tokens_per_s']:.1f}" + (f" ({over:.2f})" if over else "")


def lead(at: dict) -> str:
    """CLO's tokens/s over the best offloading baseline's at one link, naming that baseline."""
    base = {s: r["metrics"]["decode_tokens_per_s"] for s, r in at.items() if r and s not in ("clo", "fullattn")}
    if not at.get("clo") or not base:
        return "–"
    best = max(base, key=base.get)
    return f"{at['clo']['metrics']['decode_tokens_per_s'] / base[best]:.2f}x ({SYSTEMS[best]})"


def main() -> None:
    args = plot_arguments(__doc__).parse_args()
    plot(args.root, args.out)
    print(table(args.root))


if __name__ == "__main__":
    cli(main)
