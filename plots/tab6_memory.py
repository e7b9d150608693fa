"""Paper Table 6: device memory of each system's KV state by sequence length (experiments.producers.memory_table's
JSON), with the paper's Llama3 128K numbers (hatched) beside ours, and CLO's share of RetroInfer-style's memory against
the paper's 128K share and its table mean.

    python -m plots.tab6_memory results/tab6_memory --out tab6.png
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from plots import paper  # noqa: E402
from plots.markdown import f1, md, source  # noqa: E402
from plots.records import SYSTEMS, RecordError, check_systems, cli, load_files, one_value, plot_arguments, save, tokens  # noqa: E402


def model_of(rec: dict) -> str:
    models = [o.split("=", 1)[1] for o in rec.get("overrides", []) if o.startswith("model=")]
    return models[-1] if models else "smollm2"  # conf/config.yaml's default model


# the parts that are a cache of selected rows (CLO's slots and persistent heads, RetroInfer's block cache), without
# the retrieval metadata, the dense layers and the recent window every system holds
CACHE_PARTS = ("slots", "persistent", "cache")


def data(root: Path) -> dict:
    """{"rows": [{"system", "seqlen", "device_gb", "cache_gb", "host_gb", "file"}], "ratio": {seqlen: CLO /
    RetroInfer % of the device KV state}, "cache_ratio": {seqlen: the same of the cache alone}, "model", "records"}."""
    recs = load_files(root, "*.json", lambda r: "table" in r and "rows" in r, "memory tables (memory_table.py)")
    model = one_value(recs, model_of, "models")
    rows = [{**row, "file": r["file"]} for r in recs for row in r["record"]["rows"]]
    check_systems([(row["system"], row["file"]) for row in rows], recs.root)
    seen: dict[tuple, str] = {}
    for row in rows:
        key = (row["system"], row["seqlen"])
        if key in seen:
            raise RecordError(f"{row['system']} at {row['seqlen']} twice under {root}: {seen[key]}, {row['file']}")
        seen[key] = row["file"]
    for row in rows:  # the cache alone, the paper's measure: RetroInfer's 4.80 GB at 128K is 3 x top-k 10 % of 16 GiB
        row["cache_gb"] = sum(row["parts_gb"].get(k, 0.0) for k in CACHE_PARTS)
    ratio, cache_ratio = ({}, {})
    by = {(r["system"], r["seqlen"]): r for r in rows}
    for (s, n), r in by.items():
        if s == "clo" and ("retroinfer", n) in by:
            ratio[n] = r["device_gb"] / by[("retroinfer", n)]["device_gb"] * 100
            cache_ratio[n] = r["cache_gb"] / by[("retroinfer", n)]["cache_gb"] * 100
    return {"rows": rows, "ratio": ratio, "cache_ratio": cache_ratio, "model": model, "records": recs}


def plot(root: Path, out: Path) -> dict:
    d = data(root)
    rows = d["rows"]
    seqlens = sorted({r["seqlen"] for r in rows})
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in rows)]
    gb = {(r["system"], r["seqlen"]): r["device_gb"] for r in rows}
    ref = d["model"] == "llama3"  # the paper's numbers are Llama3's
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [2, 1]})
    w = 0.8 / len(systems)
    for j, s in enumerate(systems):
        xs = [i + (j - (len(systems) - 1) / 2) * w for i in range(len(seqlens))]
        ax.bar(xs, [gb.get((s, n), 0) for n in seqlens], width=w, color=f"C{j}", label=SYSTEMS[s])
        if ref and s in paper.TAB6_GB:
            ax.bar(
                len(seqlens) + (j - (len(systems) - 1) / 2) * w,
                paper.TAB6_GB[s],
                width=w,
                color="none",
                edgecolor=f"C{j}",
                hatch="//",
                label=f"{SYSTEMS[s]}, {paper.TAB6}",
            )
    groups = [tokens(n) for n in seqlens] + ([f"{tokens(paper.TAB6_SEQLEN)}\n(paper)"] if ref else [])
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("device memory of the KV state, GB")
    ax.legend(fontsize=7)
    ratio = d["ratio"]
    ax2.plot([tokens(n) for n in ratio], list(ratio.values()), "o-", label="ours, all device KV state")
    cache = d["cache_ratio"]
    ax2.plot([tokens(n) for n in cache], list(cache.values()), "s-", label="ours, cache alone (the paper's)")
    if ref:
        p = paper.TAB6_GB["clo"] / paper.TAB6_GB["retroinfer"] * 100
        ax2.axhline(p, ls="--", color="black", label=f"{paper.TAB6}: {p:.0f}%")
        ax2.axhline(
            paper.TAB6_MEAN_RATIO_PERCENT,
            ls=":",
            color="gray",
            label=f"paper Tab. 6 mean: {paper.TAB6_MEAN_RATIO_PERCENT}%",
        )
    ax2.set_ylim(0, max(100, *ratio.values(), *cache.values()) * 1.1)
    ax2.set_ylabel("CLO / RetroInfer-style, %")
    ax2.legend(fontsize=7)
    fig.suptitle(f"Device memory of the KV state: {d['model']}, BSZ 1", fontsize=9)
    save(fig, out)
    return d


def table(root: Path, folder: str) -> str:
    d = data(root)
    gb = {(r["system"], r["seqlen"]): r["device_gb"] for r in d["rows"]}
    cache = {(r["system"], r["seqlen"]): r["cache_gb"] for r in d["rows"]}
    seqlens = sorted({n for _, n in gb})
    shown = [s for s in SYSTEMS if s != "fullattn" and any(k[0] == s for k in gb)]
    mean = paper.TAB6_MEAN_RATIO_PERCENT
    rows = [
        [
            tokens(n),
            *[gb.get((s, n)) for s in shown],
            f1(d["ratio"].get(n), "%"),
            cache.get(("clo", n)),
            cache.get(("retroinfer", n)),
            f1(d["cache_ratio"].get(n), "%"),
            f"{d['cache_ratio'][n] / mean:.2f}" if n in d["cache_ratio"] else None,
        ]
        for n in seqlens
    ]
    if d["model"] == "llama3":
        p = paper.TAB6_GB
        rows.append(
            [
                f"{tokens(paper.TAB6_SEQLEN)} (paper)",
                *[None] * len(shown),
                None,
                p["clo"],
                p["retroinfer"],
                f1(p["clo"] / p["retroinfer"] * 100, "%"),
                None,
            ]
        )
    head = [
        "seqlen",
        *[f"{SYSTEMS[s]} GB" for s in shown],
        "CLO / RetroInfer-style",
        "CLO cache GB",
        "RetroInfer-style cache GB",
        "cache: CLO / RetroInfer-style",
        f"cache ratio / paper mean ({mean}%)",
    ]
    return (
        md(head, rows)
        + f"\n\n{d['model']}, device memory of the KV state, and of the cache alone (CLO's slots and persistent heads, "
        "RetroInfer-style's block cache), the paper's measure. " + source(folder, d["records"])
    )


def main() -> None:
    ap = plot_arguments(__doc__)
    args = ap.parse_args()
    for n, r in plot(args.root, args.out)["ratio"].items():
        print(f"{tokens(n):>6}: CLO {r:.0f}% of RetroInfer-style")


if __name__ == "__main__":
    cli(main)
