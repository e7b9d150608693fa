"""The fidelity README's findings, as sentences generated from the records of one length: where CLO stands among
the systems, against its own upper bounds (exact top-k, the oracle), what its reuse, retriever, eta and speculative
persistent-head query cost, what FP8 host rows cost each system, and whether the paired intervals are narrow
enough to tell these apart. Every difference is paired (the same documents and tokens) with its 95 % interval; a
difference whose interval holds 0 is said to be none measurable."""

from __future__ import annotations

from plots.bootstrap import paired
from plots.markdown import span

BASE = "clo"
TARGET_HALF_WIDTH = 0.5  # points of top-1 agreement: the paired interval a comparison needs (docs/fidelity.md)
TARGET_KL_SHARE = 0.10  # a paired KL half-width against the CLO-InfiniGen-style gap it must resolve

VARIANTS = {  # CLO's variant -> what it changes, in words
    "clo +clo_ablation=oracle": "the oracle (exact top-k of the real query every step, no reuse, no persistent heads)",
    "clo +clo_ablation=exact": "exact top-k retrieval in place of SimHash (reuse kept)",
    "clo +clo_ablation=nocache": "no reuse (SimHash top-k every step)",
    "clo +clo_ablation=learned": "HATA's learned hash in place of SimHash",
    "clo +clo_ablation=persist_speculative": "the speculative query for the persistent heads' prefetch",
    # the paper's ablation steps (conf/ablation): each adds one of CLO's policies, the last being CLO itself
    "clo +ablation=base": "none of its three policies (one threshold, the GQA minimum, no persistent heads)",
    "clo +ablation=t": "importance-aware thresholds alone (+T)",
    "clo +ablation=tg": "+T and the importance-weighted GQA mean (+T+G), no persistent heads",
}


def per_doc(rec: dict, metric: str) -> dict[str, float]:
    return {d["doc"]: d[metric] for d in rec["per_document"]}


def diff(a: dict, b: dict) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """(Δ top-1 in points, Δ KL) of a − b, each (mean, low, high)."""
    t = paired(per_doc(a, "top1"), per_doc(b, "top1"))
    k = paired(per_doc(a, "kl"), per_doc(b, "kl"))
    return tuple(100 * x for x in t), k


def said(d: tuple[float, float, float], unit: str = " points", digits: int = 2) -> str:
    mean, low, high = d
    span = f"{mean:+.{digits}f}{unit} [{low:+.{digits}f}, {high:+.{digits}f}]"
    return span if low > 0 or high < 0 else f"{span}, none measurable"


def hit(rec: dict) -> str:
    return "–" if rec["hit_rate"] is None else f"{rec['hit_rate']:.3f}"


def at_default_budget(label: str) -> bool:
    """A system at the workload's top-k, as run with no override, or with only a budget matched to the others' (a
    system whose own default is not a top-k ratio: ShadowKV-style's token budget)."""
    _, *overrides = label.split(" ")
    return not overrides or (len(overrides) == 1 and overrides[0].startswith("system.topk_ratio="))


def model_twin(by: dict, label: str) -> dict | None:
    """The run of an FP8 run's system in the model's dtype: kv_dtype=model named or left at its default."""
    return by.get(label.replace("kv_dtype=fp8", "kv_dtype=model")) or by.get(label.replace(" kv_dtype=fp8", ""))


def findings(records: list[dict]) -> list[str]:
    by = {r["label"]: r for r in records}
    base = by.get(BASE) or by.get(f"{BASE} kv_dtype=model")  # CLO at its defaults, its dtype named or not
    if base is None:
        return []
    out = []
    against = {r["label"]: diff(r, base) for r in records if r is not base}  # each paired bootstrap once
    systems = [r for r in records if at_default_budget(r["label"]) and r["label"] not in ("fullattn", BASE)]
    if systems:
        ranked = sorted([base, *systems], key=lambda r: -r["summary"]["top1"]["mean"])
        out.append(
            "By top-1 agreement: "
            + ", ".join(f"{r['label']} {100 * r['summary']['top1']['mean']:.2f} %" for r in ranked)
            + ". Each baseline minus CLO, paired (top-1; KL): "
            + "; ".join(
                f"{r['label']} {said(against[r['label']][0])}; {said(against[r['label']][1], '', 4)}" for r in systems
            )
            + "."
        )
    for label, what in VARIANTS.items():
        if label in by:
            t, k = against[label]
            plan = by[label].get("system_state", {}).get("plan", {})
            why = ""
            if label.endswith("persist_speculative") and plan.get("persistent_heads") == 0:
                why = f" (its plan has no persistent heads: Eq. 12's N_p of {plan['n_p']} covers every hard head)"
            if label.startswith("clo +ablation="):  # the policies are about reuse: what it costs the link too
                r = by[label]
                why = (
                    f" (hit rate {hit(r)} against {hit(base)}; host→device {r['bytes_h2d_per_step'] / 1e3:.0f} "
                    f"against {base['bytes_h2d_per_step'] / 1e3:.0f} KB a step)"
                )
                none = by.get("clo +ablation=base")
                if r is not none and none is not None and r["per_document"] == none["per_document"]:
                    why += (  # +T's thresholds come from the heads' importance: uniform, every head keeps eta
                        ", document for document the same as with none of the policies: its importance is "
                        f"{r.get('system_state', {}).get('importance', 'unrecorded')}"
                    )
            out.append(f"CLO with {what}, minus CLO: top-1 {said(t)}; KL {said(k, '', 4)}{why}.")
    etas = sorted((r for r in records if r["label"].startswith("clo +clo_ablation=eta")), key=lambda r: r["label"])
    if etas:
        eta = lambda r: r["label"].rsplit("eta", 1)[1]  # noqa: E731
        out.append(
            "CLO's eta (default 0.8: top-1, hit rate (–: no step reused a selection), host→device KB a step): "
            + "; ".join(
                f"{eta(r) if r is not base else '0.8'}: {100 * r['summary']['top1']['mean']:.2f} %, "
                f"{hit(r)}, {r['bytes_h2d_per_step'] / 1e3:.0f}"
                for r in sorted([*etas, base], key=lambda r: eta(r) if r is not base else "0.8")
            )
            + "."
        )
    fp8 = [(r, model_twin(by, r["label"])) for r in records if r["label"].endswith("kv_dtype=fp8")]
    if fp8:
        out.append(
            "FP8 host rows minus the same system's model-dtype rows (top-1; KL): "
            + "; ".join(
                f"{r['label'].split()[0]} {said(t)}; {said(k, '', 4)}"
                for r, (t, k) in ((r, diff(r, ref)) for r, ref in fp8 if ref is not None)
            )
            + "."
        )
    widths = {label: (t[2] - t[1]) / 2 for label, (t, _) in against.items()}
    if widths:
        wide = sorted((w, label) for label, w in widths.items() if w > TARGET_HALF_WIDTH)
        shared = sorted({len(set(per_doc(r, "top1")) & set(per_doc(base, "top1"))) for r in records if r is not base})
        docs = f"{shared[0]}" if len(shared) == 1 else f"{shared[0]} to {shared[-1]}"
        out.append(
            f"Paired top-1 intervals against CLO ({docs} documents shared) have half-widths of "
            f"{span(widths.values())} points; above the {TARGET_HALF_WIDTH} points a comparison needs: "
            + (", ".join(f"{label} {w:.2f}" for w, label in wide) or "none")
            + "."
        )
    ig = by.get("infinigen")
    if ig is not None:
        gap, low, high = against["infinigen"][1]
        share = (high - low) / 2 / abs(gap)
        verdict = "within" if share <= TARGET_KL_SHARE else "not within"
        out.append(
            f"The paired KL interval of InfiniGen-style against CLO has a half-width of {100 * share:.0f} % of their "
            f"gap, {verdict} the {100 * TARGET_KL_SHARE:.0f} % that ranks them tightly."
        )
    return out
