"""The host-memory blocks of results/bench/README.md (plots.bench_readme): pinning a host store by cudaHostAlloc, by
threads + cudaHostRegister and on huge pages, with the link's rates on the memory each pins (bench_pin_alloc's
records), and InfiniGen-style's prefill eigh on the device and the host (bench_skew_eigh's)."""

from __future__ import annotations

from pathlib import Path

from plots.markdown import md, span
from plots.readme_parts import machine
from plots.records import commit_of, read_json

GIB = 1 << 30


def way(r: dict) -> str:
    if r["way"] == "cudaHostAlloc":
        n = r.get("alloc_threads", 1)
        return "cudaHostAlloc" + (f" from {n} threads at once" if n > 1 else "")
    return f"malloc, {r['threads']} threads' first touch, cudaHostRegister" + (" on huge pages" if r.get("thp") else "")


def link(r: dict) -> dict[str, dict]:
    return {x["path"]: x for x in r["link"]}


def pin(folder: Path, name: str) -> str:
    rec = read_json(folder / f"{name}.json")
    rows = rec["rows"]
    body = []
    for r in rows:
        lk = link(r)
        body.append(
            [
                f"{way(r)} (`pin_threads` {r['threads']})",
                f"{r['alloc_s']:.2f} s",
                f"{r['free_s']:.2f} s",
                f"{lk['bulk']['gb_s']:.1f}",
                f"{lk['uva']['gb_s']:.1f} ({lk['uva']['of_bulk']:.2f})",
                f"{lk['cpu_gather']['gb_s']:.1f} ({lk['cpu_gather']['of_bulk']:.2f})",
            ]
            + ([f"{r['anon_huge_gib']:.1f}"] if "anon_huge_gib" in r else [])
        )
    size = rows[0]["bytes"] / GIB
    head = ["way", f"pin {size:.0f} GiB", "free", "bulk GB/s", "UVA gather GB/s (of bulk)"]
    head += ["CPU gather, 16 threads, GB/s (of bulk)"] + (["huge pages GiB"] if "anon_huge_gib" in rows[0] else [])
    base = rows[0]
    faster = [base["alloc_s"] / r["alloc_s"] for r in rows[1:]]
    return (
        f"`{name}.json`: commit {commit_of(rec)}, {machine(rec)}; {size:.0f} GiB in {rows[0]['layers']} buffers of "
        f"{size / rows[0]['layers']:.0f} GiB, {rec['link_tokens']} rows of one "
        f"layer for the link's rates; one run each.\n\n"
        + md(head, body)
        + f"\n\nAgainst the first row, pinning is {span(faster, '{:.1f}')}x faster; CLO's UVA gather reads the "
        f"others' memory at {span([link(r)['uva']['gb_s'] / link(base)['uva']['gb_s'] for r in rows[1:]])}x its "
        "rate on the first row's."
    )


def eigh(folder: Path) -> str:
    rec = read_json(folder / "skew_eigh.json")
    s = rec["shape"]
    where = lambda r: (
        r["where"] + (f" ({r['threads']} thread{'s' if r['threads'] > 1 else ''})" if r["threads"] else "")
    )
    rows = "; ".join(f"{where(r)} {r['s']:.3f} s ({r['ms_per_matrix']:.2f} ms a matrix)" for r in rec["rows"])
    return (
        f"`skew_eigh.json`: commit {commit_of(rec)}, {machine(rec)}. {s['matrices']} Gram matrices of "
        f"{s['head_dim']} x {s['head_dim']}: {rows}. The two top-{s['rank']} subspaces agree to {rec['gap']:.1e} "
        "(Frobenius gap of the projections)."
    )


def blocks(folder: Path) -> dict[str, str]:
    return {"pin_alloc": pin(folder, "pin_alloc"), "pin_alloc_thp": pin(folder, "pin_alloc_thp"), "eigh": eigh(folder)}
