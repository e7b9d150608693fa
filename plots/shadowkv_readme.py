"""The generated block of results/shadowkv/README.md (plots.readmes): where ShadowKV-style stands against CLO, from
the records of the folders that hold both: device and host memory (Table 6), fidelity at the same top-k budget (the
fidelity workload), and decode throughput wherever both ran in a Figure 10 folder. A side with no records yet says
so instead of a number."""

from __future__ import annotations

from pathlib import Path

from plots import fidelity, fig10_throughput, tab6_memory
from plots.fidelity_findings import diff, said
from plots.markdown import span
from plots.records import NoRecords, RecordError, tokens

MATCHED = "shadowkv system.topk_ratio=0.1"  # its fidelity run at the others' top-k (its own default is a token budget)
FIG10_FOLDERS = ("fig10_throughput", "fig10_beyond", "fig10_fp8")


def memory(results: Path) -> list[str]:
    rows = {(r["system"], r["seqlen"]): r for r in tab6_memory.data(results / "tab6_memory")["rows"]}
    ns = sorted(n for s, n in rows if s == "shadowkv" and ("clo", n) in rows)
    if not ns:
        return ["- Memory: no Table 6 row of both yet."]
    gb = {k: r["device_gb"] for k, r in rows.items()}
    dev = ", ".join(f"{tokens(n)} {gb['shadowkv', n]:.2f} / {gb['clo', n]:.2f}" for n in ns)
    host = [rows["shadowkv", n]["host_gb"] / rows["clo", n]["host_gb"] for n in ns]
    return [
        f"- **Device memory** of the KV state, ShadowKV-style / CLO (GB, BSZ 1): {dev}. ShadowKV-style keeps "
        "low-rank keys, landmarks, outliers and the window on the device, CLO a cache of selected rows and its "
        "persistent heads.",
        f"- **Host memory**: ShadowKV-style's store is {span(host, '{:.0%}')} of CLO's (it offloads the "
        "values only; the keys are rebuilt from the low-rank factors), so the host's RAM holds about "
        f"{1 / max(host):.1f}x the sequences before it refuses a batch.",
    ]


def fidelity_side(results: Path) -> list[str]:
    out = []
    for length, records in fidelity.by_length(fidelity.load(results / "fidelity")).items():
        by = {r["label"]: r for r in records}
        if MATCHED not in by or "clo" not in by:
            continue
        s, c = by[MATCHED], by["clo"]
        top1, kl = diff(s, c)
        out.append(
            f"- **Fidelity at {tokens(length)}**, both at top-k 10 % ({len(s['per_document'])} documents): "
            f"ShadowKV-style minus CLO, top-1 agreement {said(top1)}, KL {said(kl, '', 4)}; attention mass "
            f"{s['summary']['mass']['mean']:.3f} against {c['summary']['mass']['mean']:.3f}."
        )
    return out or ["- Fidelity: no length with both runs yet."]


def speed(results: Path) -> list[str]:
    out = []
    for folder in FIG10_FOLDERS:
        try:
            pts = fig10_throughput.data(results / folder, allow_mixed=True)["points"]
        except (NoRecords, RecordError):
            continue
        both = sorted((n, b) for s, n, b in pts if s == "shadowkv" and ("clo", n, b) in pts)
        if both:
            tps = {k: p["decode_tokens_per_s"] for k, p in pts.items()}
            ratios = ", ".join(f"{tokens(n)} BSZ {b} {tps['clo', n, b] / tps['shadowkv', n, b]:.2f}x" for n, b in both)
            out.append(f"- **Decode throughput**, CLO / ShadowKV-style (`{folder}`): {ratios}.")
    return out or [
        "- **Decode throughput**: no GPU run of ShadowKV-style in a Figure 10 folder yet, so where it is faster than "
        "CLO is not measured."
    ]


def blocks(folder: Path) -> dict[str, str]:
    results = folder.parent
    return {"answer": "\n".join(memory(results) + fidelity_side(results) + speed(results))}
