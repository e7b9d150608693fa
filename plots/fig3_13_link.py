"""Paper Figures 3 and 13 from experiments/bench/bench_link.py's record: (a) the bandwidth of each transfer path against
the transfer volume (tokens per KV head of one layer), the bulk pinned copy of the same run as the ceiling; (b)
the CPU gather's bandwidth against its thread count at the largest volume, the UVA gather and the bulk copy as
lines. The paper's GDRCopy peak (21.21 GB/s with 4 threads on PCIe 4.0) is drawn in both.

    python -m plots.fig3_13_link results/fig3_13_link --out fig3_13.png
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from plots import paper  # noqa: E402
from plots.markdown import md, source  # noqa: E402
from plots.records import RecordError, cli, load_files, plot_arguments, save, tokens  # noqa: E402

PATHS = ("bulk", "uva", "cpu_gather")


def data(root: Path) -> dict:
    """{"rows": the record's rows, "device", "record", "records"}: one bench_link record."""
    recs = load_files(root, "*.json", lambda r: r.get("bench") == "link_bandwidth", "link bandwidth records")
    if len(recs) > 1:
        raise RecordError(f"one link record per figure; under {root}: {', '.join(recs.files)}")
    rec = recs.rows[0]["record"]
    bad = sorted({r["path"] for r in rec["rows"]} - set(PATHS))
    if bad:
        raise RecordError(f"unknown transfer path {', '.join(bad)} in {recs.files[0]}; known: {', '.join(PATHS)}")
    if not any(r["path"] == "bulk" for r in rec["rows"]):
        raise RecordError(f"no bulk copy in {recs.files[0]}: the paths are measured against it")
    # the real link's rows: a record made with --link-gb-s also holds each cap's paced rows (cap_gb_s set)
    rows = [r for r in rec["rows"] if r.get("cap_gb_s") is None]
    return {"rows": rows, "device": rec["device"], "record": rec, "records": recs}


def series(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """label -> [(tokens, GB/s)], one per path and thread count."""
    out: dict[str, list] = {}
    for r in rows:
        label = r["path"] + (f" {r['threads']} thr" if r.get("threads") else "")
        out.setdefault(label, []).append((r["tokens"], r["gb_s"]))
    return {k: sorted(v) for k, v in out.items()}


def plot(root: Path, out: Path) -> dict:
    d = data(root)
    rows = d["rows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for label, pts in series(rows).items():
        style = {"color": "black", "lw": 2} if label == "bulk" else {}
        a.plot([t for t, _ in pts], [g for _, g in pts], "o-", label=label, ms=3, **style)
    a.set_xscale("log", base=2)
    xs = sorted({r["tokens"] for r in rows})
    a.set_xticks(xs, [tokens(x) for x in xs], fontsize=7)
    a.set_xlabel("transfer volume, tokens per KV head (one layer)")
    a.set_ylabel("GB/s")
    top = max(xs)
    cpu = sorted((r["threads"], r["gb_s"]) for r in rows if r["path"] == "cpu_gather" and r["tokens"] == top)
    b.plot([n or 1 for n, _ in cpu], [g for _, g in cpu], "o-", label="cpu_gather")
    for path, style in (("bulk", "-"), ("uva", "--")):
        for r in (r for r in rows if r["path"] == path and r["tokens"] == top):
            b.axhline(r["gb_s"], ls=style, color="black" if path == "bulk" else "C1", label=f"{path} (0 CPU threads)")
    b.set_xscale("log", base=2)
    b.set_xlabel(f"CPU threads (volume {tokens(top)} tokens)")
    b.set_ylabel("GB/s")
    if d["device"] == "cuda":
        a.axhline(paper.FIG3_PEAK_GB_S, ls=":", color="gray", label=f"{paper.FIG3} ({paper.FIG3_PEAK_GB_S} GB/s)")
        b.scatter([paper.FIG3_PEAK_THREADS], [paper.FIG3_PEAK_GB_S], marker="*", s=120, color="gray", label=paper.FIG3)
    for ax in (a, b):
        ax.legend(fontsize=6)
    fig.suptitle(
        f"Fig. 3/13: link bandwidth on {d['device']}"
        + (" (no link: a host copy, checks only)" if d["device"] != "cuda" else ""),
        fontsize=9,
    )
    save(fig, out)
    return d


COLUMNS = (("uva", None), ("cpu_gather", paper.FIG3_PEAK_THREADS))  # the link table's paths beside the bulk copy


def table(root: Path, folder: str) -> str:
    d = data(root)
    by = {(r["path"], r.get("threads"), r["tokens"]): r for r in d["rows"]}
    rows = [
        [
            tokens(t),
            by[("bulk", None, t)]["gb_s"],
            *[by.get((p, n, t), {}).get("gb_s") for p, n in COLUMNS],
            f"{by[(*COLUMNS[1], t)]['gb_s'] / paper.FIG3_PEAK_GB_S:.2f}" if (*COLUMNS[1], t) in by else None,
        ]
        for t in sorted({r["tokens"] for r in d["rows"]})
    ]
    head = ["tokens", "bulk GB/s", "uva GB/s", "cpu_gather 4 threads GB/s", f"4 threads / {paper.FIG3_PEAK_GB_S}"]
    return md(head, rows) + f"\n\nOn {d['device']}. " + source(folder, d["records"])


def main() -> None:
    ap = plot_arguments(__doc__)
    args = ap.parse_args()
    print(f"{len(plot(args.root, args.out)['rows'])} rows -> {args.out}")


if __name__ == "__main__":
    cli(main)
