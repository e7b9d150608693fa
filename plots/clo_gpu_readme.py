"""The generated blocks of results/clo_gpu/README.md (plots.readmes): CLO and FullAttn pairs replayed from a CUDA
graph at 32K, 128K and 512K (this folder's run records and Figure 2's 128K pair beside it), CLO's configuration and
measured plan inputs, the table against each system's floors, what the pairs show, the GPU tests of the calls (their
logs in ../bench/) and the ledger's rows of earlier runs of these pairs."""

from __future__ import annotations

import re
from pathlib import Path

from plots.markdown import md, span
from plots.readme_parts import machine, pytest_summary
from plots.records import SYSTEMS, commit_of, load_records, tokens

FIG2 = "fig2_breakdown_128k"  # Figure 2's 128K pair, the same workload in its own sweep
TESTS = ("pytest_clo_gpu_d8ba0fa.log", "pytest_gpu_85c49ab.log")  # the calls' GPU test logs, kept in ../bench/
MB = 1e6


def runs(folder: Path) -> list[dict]:
    """This folder's records, then Figure 2's CLO and FullAttn at 128K (file named from this folder)."""
    rows = load_records(folder, allow_mixed=True).rows
    fig2 = folder.parent / FIG2
    if fig2.is_dir():
        for r in load_records(fig2, allow_mixed=True).rows:
            if r["record"]["system"] in ("clo", "fullattn") and "untimed" not in r["file"]:
                rows.append({**r, "file": f"../{FIG2}/{r['file']}"})
    return rows


def label(rec: dict) -> str:
    name = SYSTEMS[rec["system"]]
    pinned = [o.split("=", 1)[1] for o in rec["overrides"] if o.startswith("system.persist_query=")]
    if rec["system"] == "clo" and pinned:
        return f"{name}, plan inputs pinned, `persist_query={pinned[0]}`"
    return name


def pair(rows: list[dict], seqlen: int, file_prefix: str = "record_") -> dict[str, dict]:
    """system -> record of the default pair at seqlen in this folder (no pinned plan)."""
    return {
        r["record"]["system"]: r["record"]
        for r in rows
        if r["record"]["seqlen"] == seqlen and r["file"].startswith(file_prefix) and "np0" not in r["file"]
    }


def table(rows: list[dict]) -> str:
    head = ["record", "commit", "seqlen", "system", "ms/step", "dense floor", "own floor", "x own floor", "hit rate"]
    head += ["link MB/step", "host syncs/step", "persistent / prefetch heads"]
    body = []
    for r in sorted(rows, key=lambda r: (r["record"]["seqlen"], r["file"].startswith(".."), r["file"])):
        x, m = r["record"], r["record"]["metrics"]
        plan = (x.get("system_state") or {}).get("plan")
        own = m.get("system_floor_ms_per_step")
        body.append(
            [
                f"`{r['file']}`",
                commit_of(x),
                tokens(x["seqlen"]),
                label(x),
                f"{m['decode_ms_per_step']:.2f}",
                f"{m['dense_floor_ms_per_step']:.2f}",
                "-" if own is None else f"{own:.2f}",
                "-" if own is None else f"{m['step_over_system_floor']:.2f}",
                "-" if m.get("hit_rate") is None else f"{m['hit_rate']:.3f}",
                f"{m['bytes_h2d_per_step'] / MB:.0f}",
                f"{m['host_syncs_per_step']:.0f}",
                f"{plan['persistent_heads']} / {plan['prefetch_heads']}" if plan else "-",
            ]
        )
    machines = sorted({machine(r["record"]) for r in rows})
    return md(head, body) + "\n\nOn " + "; ".join(machines) + "."


def query_process(rec: dict) -> str:
    """The query process a run drew from: workload.query_process, or the model's default where it says auto."""
    q = rec["config"]["workload"]["query_process"]
    return rec["config"]["model"].get("synthetic_queries") if q == "auto" else q


def config(rows: list[dict]) -> str:
    clo = [r["record"] for r in rows if r["record"]["system"] == "clo" and not r["file"].startswith("..")]
    c = clo[0]["config"]["system"]
    own = [x for x in clo if not any(o.startswith("system.layer_time_ms") for o in x["overrides"])]
    t = [x["system_state"]["layer_time_ms"] for x in own]
    link = [x["system_state"]["link_gb_s"] for x in own]
    queries = sorted({query_process(x) for x in clo})
    profiles = sorted({x["config"]["system"]["profile"] for x in clo})
    return "\n".join(
        [
            f"- top-k ratio {c['topk_ratio']}, {c['retriever']} retrieval ({clo[0]['system_state']['retriever']}), "
            f"rbit {c['rbit']};",
            f"- eta {c['eta']}, n {c['n']:g}, importance of {c['importance']}; reuse profiles "
            + ", ".join(f"`{p}`" for p in profiles)
            + ";",
            f"- {c['dense_layers']} dense layers, {c['transfer'].upper()} transfer with {c['uva_programs']} programs, "
            f"`persist_query={c['persist_query']}`;",
            f"- the plan from the measured T_comp (graph-replayed layer, {span(t, '{:.3f}', ' ms')}) and link "
            f"({span(link, '{:.1f}', ' GB/s')}), where a run did not pin them.",
            "- query processes: " + ", ".join(f"`{q}`" for q in queries) + ".",
        ]
    )


def at_512k(rows: list[dict]) -> str:
    p = pair(rows, max(r["record"]["seqlen"] for r in rows))
    clo, full = p["clo"], p["fullattn"]
    mc, mf = clo["metrics"], full["metrics"]
    s, model = clo["config"]["system"], clo["config"]["model"]
    k = s["topk_ratio"] * clo["seqlen"]
    head_mb = k * 2 * model["head_dim"] * 2 / MB  # K and V rows of bf16
    plan = clo["system_state"]["plan"]
    return (
        f"At {tokens(clo['seqlen'])} a head's top-k ({k:,.0f} rows, {head_mb:.0f} MB) takes longer over the "
        f"link than a layer computes, so Eq. 12 plans {plan['prefetch_heads']} prefetch heads and "
        f"{plan['persistent_heads']} persistent ones (no device budget here). **CLO's step is "
        f"{mc['decode_ms_per_step'] / mf['decode_ms_per_step']:.2f}x FullAttn's** ({mc['decode_ms_per_step']:.2f} "
        f"vs {mf['decode_ms_per_step']:.2f} ms/step, one call at {commit_of(clo)}): FullAttn runs at "
        f"{mf['decode_ms_per_step'] / mf['dense_floor_ms_per_step']:.2f}x its dense floor (the floor's bandwidth is a "
        f"measured copy's, "
        f"{mf['bandwidth_gb_s'] / 1000:.1f} TB/s), CLO at {mc['step_over_system_floor']:.2f}x its own floor. CLO "
        f"holds {mc['kv_device_gb']:.1f} GB of KV on the device and {mc['kv_host_gb']:.0f} GB pinned on the host "
        f"(peak device {mc['peak_device_gb']:.1f} GB), FullAttn {mf['kv_device_gb']:.1f} GB of KV (peak "
        f"{mf['peak_device_gb']:.1f} GB). Prefill: FullAttn {mf['prefill_s']:.0f} s "
        f"({mf['prefill_tokens_per_s']:,.0f} tokens/s), CLO {mc['prefill_s']:.0f} s "
        f"({mc['prefill_tokens_per_s']:,.0f} tokens/s, {mc['prefill_tokens_per_s'] / mf['prefill_tokens_per_s']:.2f}x)."
    )


def shorter(rows: list[dict]) -> str:
    lens = sorted({r["record"]["seqlen"] for r in rows})[:-1]
    out = []
    for n in reversed(lens):
        p = pair(rows, n)
        c, f = p["clo"]["metrics"], p["fullattn"]["metrics"]
        plan = p["clo"]["system_state"]["plan"]
        out.append(
            f"- {tokens(n)}, one call at {commit_of(p['clo'])}: CLO {c['decode_ms_per_step']:.2f} vs FullAttn "
            f"{f['decode_ms_per_step']:.2f} ms/step ({c['decode_ms_per_step'] / f['decode_ms_per_step']:.2f}x); "
            f"Eq. 12 plans N_p = {plan['n_p']} ({plan['prefetch_heads']} prefetch heads)."
        )
    fig2 = pair(rows, max(lens), f"../{FIG2}/")
    if {"clo", "fullattn"} <= set(fig2):
        c, f = fig2["clo"]["metrics"], fig2["fullattn"]["metrics"]
        out.append(
            f"- Figure 2's sweep at {tokens(max(lens))} ({commit_of(fig2['clo'])}): {c['decode_ms_per_step']:.2f} vs "
            f"{f['decode_ms_per_step']:.2f} ({c['decode_ms_per_step'] / f['decode_ms_per_step']:.2f}x)."
        )
    own = [
        r["record"]["metrics"]["step_over_system_floor"]
        for r in rows
        if r["record"]["system"] == "clo" and r["record"]["seqlen"] == max(lens) and not r["file"].startswith("..")
    ]
    out.append(f"- CLO's step over its own floor at {tokens(max(lens))}, this folder's rows: {span(own)}x.")
    return "\n".join(out)


def tests(folder: Path) -> str:
    bench = folder.parent / "bench"
    return "; ".join(f"`../bench/{n}`: {pytest_summary(bench / n)}" for n in TESTS if (bench / n).is_file()) + "."


def ledger(folder: Path) -> str:
    """The ledger's rows whose numbers this README's pairs superseded or quote (their last column names clo_gpu/)."""
    path = folder.parent / "LEDGER.md"
    if not path.is_file():
        return "No ledger beside this folder."
    found = [
        m[1]
        for line in path.read_text().splitlines()
        if (m := re.match(r"\| `?([^`|]+?)`? \|", line)) and "clo_gpu/" in line.rsplit("|", 2)[-2]
    ]
    return (
        "Earlier runs of these pairs, with their numbers, in `../LEDGER.md`: "
        + ", ".join(f"`{f}`" for f in found)
        + "."
    )


def files(folder: Path) -> str:
    logs = sorted(p.name for p in folder.glob("*.log"))
    envs = sorted(p.name for p in folder.glob("env*.txt"))
    return "Logs: " + ", ".join(f"`{x}`" for x in logs) + "; machine: " + ", ".join(f"`{x}`" for x in envs) + "."


def blocks(folder: Path) -> dict[str, str]:
    rows = runs(folder)
    return {
        "files": files(folder),
        "config": config(rows),
        "table": table(rows),
        "at_512k": at_512k(rows),
        "shorter": shorter(rows),
        "tests": tests(folder),
        "ledger": ledger(folder),
    }
