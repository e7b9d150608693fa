"""What an accuracy record says in short: the cost per sample of a system, and the lines printed after a run."""

from __future__ import annotations

import statistics


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.fmean(values), 4) if values else None


def cost_summary(results: dict[str, dict]) -> dict:
    """Means over every sample of the run (all tasks and lengths). prefill_s counts the prefills computed in this
    run (a shared one was paid by the system that ran first); system_s = handing the prefill to the system (load_s)
    + its decode, what differs between systems."""
    costs = [s["cost"] for r in results.values() for ln in r.values() for s in ln["samples"] if s.get("cost")]
    own = [c for c in costs if not c.get("prefill_shared")]
    return {
        "samples": len(costs),
        "prefills_computed": len(own),
        "prompt_tokens": _mean(c["prompt_tokens"] for c in costs),
        "new_tokens": _mean(c.get("new_tokens") for c in costs),
        "prefill_s": _mean(c["prefill_s"] for c in own),
        "load_s": _mean(c.get("load_s") for c in costs),
        "decode_s": _mean(c.get("decode_s") for c in costs),
        "decode_ms_per_step": _mean(c.get("decode_ms_per_step") for c in costs),
        "system_s": _mean((c.get("load_s") or 0) + (c.get("decode_s") or 0) for c in costs),
        "hit_rate": _mean(c.get("hit_rate") for c in costs),
    }


def summary_lines(rec: dict) -> list[str]:
    c = rec["cost_per_sample"]
    lines = [f"== accuracy | {rec['system']} | {rec['model']} ({rec['weights']})"]
    for task, by_length in rec["tasks"].items():
        for length, r in by_length.items():
            lines.append(f"   {task} @ {length}: score {r['score']} over {r['n']} samples ({r['wall_s']} s)")
    lines += [f"   skipped: {s}" for s in rec["skipped"]]
    lines.append(
        f"   per sample: {c['prompt_tokens']} prompt tokens, {c['new_tokens']} generated; prefill {c['prefill_s']} s "
        f"({c['prefills_computed']} of {c['samples']} computed here), system {c['system_s']} s "
        f"(decode {c['decode_ms_per_step']} ms/step, hit rate {c['hit_rate']})"
    )
    return lines
