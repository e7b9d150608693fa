"""The generated blocks of results/fig3_13_link/README.md (plots.readmes): where the link bench ran, what it
moved, its table of GB/s and how it stands against the paper's Figures 3/13, from plots.fig3_13_link's reading of
the record."""

from __future__ import annotations

from pathlib import Path

from plots import fig3_13_link, paper
from plots.markdown import span
from plots.readme_parts import commit, machine
from plots.records import tokens

MIB = 1 << 20


def rows_by(d: dict) -> dict[tuple, dict]:
    return {(r["path"], r.get("threads"), r["tokens"]): r for r in d["rows"]}


def environment(folder: Path) -> str:
    d = fig3_13_link.data(folder)
    rec = d["record"]
    return (
        f"{commit(rec).capitalize()} (in the record's environment), "
        f"{machine(rec, folder / 'env.txt')} (`env.txt`, the record's `environment`). "
        f"Record `{d['records'].files[0]}` ({len(rec['rows'])} rows), the stage's output `run.log`."
    )


def setup(folder: Path) -> str:
    rec = fig3_13_link.data(folder)["record"]
    s = rec["shape"]
    return (
        f"A volume of T tokens is T rows of each of the {s['kv_heads']} KV heads of one Llama-3-8B layer, "
        f"{s['row_bytes']} B a row (K and V, head_dim {s['head_dim']}), picked at random among T / {rec['fraction']} "
        f"rows of the head (a {rec['fraction']:.0%} top-k); median of {rec['iters']} iterations; the UVA gather "
        f"runs {rec['uva_programs']} programs."
    )


def exact(folder: Path) -> str:
    rows = [r for r in fig3_13_link.data(folder)["rows"] if "exact_rows" in r]
    wrong = [r for r in rows if not r["exact_rows"]]
    if not wrong:
        return f"All {len(rows)} gathering rows have `exact_rows: true` (the rows that arrived are the rows asked for)."
    return f"**{len(wrong)} of {len(rows)} gathering rows have `exact_rows: false`.**"


def table(folder: Path) -> str:
    d = fig3_13_link.data(folder)
    by = rows_by(d)
    threads = sorted({r["threads"] for r in d["rows"] if r["path"] == "cpu_gather"})
    head = ["tokens", "MiB", "bulk", "UVA gather"] + [
        f"CPU gather {n} thr" if i == 0 else f"{n} thr" for i, n in enumerate(threads)
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in sorted({r["tokens"] for r in d["rows"]}):
        bulk = by[("bulk", None, t)]
        cells = [tokens(t), f"{bulk['bytes'] // MIB}", f"{bulk['gb_s']:.2f}"]
        for key in [("uva", None, t)] + [("cpu_gather", n, t) for n in threads]:
            r = by.get(key)
            cells.append(f"{r['gb_s']:.2f} ({r['of_bulk']:.2f})" if r else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def findings(folder: Path) -> str:
    d = fig3_13_link.data(folder)
    by = rows_by(d)
    ts = sorted({r["tokens"] for r in d["rows"]})
    top, small = ts[-1], ts[0]
    bulk = {t: by[("bulk", None, t)] for t in ts}
    uva = {t: by[("uva", None, t)] for t in ts}
    cpu = [r for r in d["rows"] if r["path"] == "cpu_gather"]
    threads = sorted({r["threads"] for r in cpu})
    best = max(cpu, key=lambda r: r["gb_s"])
    at_top = {n: by[("cpu_gather", n, top)] for n in threads if ("cpu_gather", n, top) in by}
    big = [uva[t] for t in ts[1:]]
    flat = [uva[t] for t in ts[2:]]
    four = [by[("cpu_gather", paper.FIG3_PEAK_THREADS, t)]["gb_s"] for t in ts]
    shown = [n for n in (1, paper.FIG3_PEAK_THREADS, threads[-1]) if n in at_top]
    return "\n".join(
        [
            f"- **Agrees: the zero-copy path runs near the link's ceiling.** The UVA gather reaches "
            f"{span([r['gb_s'] for r in big], unit=' GB/s')}, {span([r['of_bulk'] for r in big])} of the bulk pinned "
            f"copy, from {tokens(ts[1])} to {tokens(top)} tokens, with 0 CPU threads; at {tokens(top)}, "
            f"{uva[top]['gb_s']:.2f} GB/s against bulk {bulk[top]['gb_s']:.2f} ({uva[top]['of_bulk']:.2f}).",
            "- **Agrees: the CPU gather is far below it.** The baselines' gather + copy reaches "
            + ", ".join(f"{at_top[n]['gb_s']:.2f} GB/s ({n} thr)" for n in shown)
            + f" at {tokens(top)}, "
            + " / ".join(f"{at_top[n]['of_bulk']:.2f}" for n in shown)
            + f" of bulk; the best CPU-gather point anywhere is {best['gb_s']:.2f} GB/s ({best['threads']} threads, "
            f"{tokens(best['tokens'])}), {best['of_bulk']:.2f} of bulk. {threads[-1]} threads give "
            f"{at_top[threads[-1]]['gb_s'] / uva[top]['gb_s']:.2f}x the UVA gather's bandwidth at {tokens(top)}.",
            f"- **Differs: flatness at the smallest volume.** The UVA gather is "
            f"{span([r['gb_s'] for r in flat], unit=' GB/s')} from {tokens(ts[2])} to {tokens(top)} and "
            f"{uva[small]['gb_s']:.2f} GB/s ({uva[small]['of_bulk']:.2f} of bulk) at {tokens(small)} "
            f"({bulk[small]['bytes'] // MIB} MiB); the bulk copy is {span([r['gb_s'] for r in bulk.values()])} GB/s "
            "over the whole range.",
            f"- **Not comparable: the absolute number.** The paper's {paper.FIG3_PEAK_GB_S} GB/s is a PCIe 4.0 peak "
            f"with {paper.FIG3_PEAK_THREADS} CPU threads; this link's bulk pinned copy moves "
            f"{span([r['gb_s'] for r in bulk.values()])} GB/s. Our {paper.FIG3_PEAK_THREADS}-thread CPU gather "
            f"({span(four)} GB/s) is a different path from the paper's {paper.FIG3_PEAK_THREADS}-thread GDRCopy.",
        ]
    )


def claim(folder: Path) -> str:
    return (
        f"Paper (Fig. 3/13): CLO's GDRCopy path with {paper.FIG3_PEAK_THREADS} CPU threads (AVX) reaches the GDRCopy "
        f"peak of {paper.FIG3_PEAK_GB_S} GB/s on PCIe 4.0, flat over 4K-128K tokens."
    )


def blocks(folder: Path) -> dict[str, str]:
    return {
        "environment": environment(folder),
        "setup": setup(folder),
        "exact": exact(folder),
        "table": table(folder),
        "claim": claim(folder),
        "findings": findings(folder),
    }
