"""Table 5's ablations: CLO's accuracy and real hit rate per variant (+clo_ablation: the retriever, SimHash vs learned
HATA hash vs exact top-k, eta 0.6-0.9, and no cache reuse), on the same samples. Reads the records of
`python -m experiments.accuracy --multirun +experiment=tab5_ablation`; a record names its variant in its overrides.
Only cells that every variant scored enter the means, so that each variant is averaged over the same samples.

    python -m plots.tab5_ablation results/tab5_ablation --out tab5_ablation
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from plots.markdown import md, source  # noqa: E402
from plots.records import (  # noqa: E402
    RecordError,
    cli,
    commit_of,
    commit_per_cell,
    load_files,
    names,
    plot_arguments,
    save,
)
from plots.tab5_accuracy import is_accuracy, scores_of  # noqa: E402

VARIANTS = ("simhash", "nocache", "learned", "exact", "eta0.6", "eta0.7", "eta0.9")  # conf/clo_ablation, drawing order
KEY = "+clo_ablation="


def variant_of(rec: dict) -> str | None:
    found = [o[len(KEY) :] for o in rec.get("overrides") or [] if isinstance(o, str) and o.startswith(KEY)]
    return found[0] if len(found) == 1 else None


def data(root: Path) -> dict:
    """{"scores": {variant: {cell: score}}, "hit_rate": {variant: mean over the cells}, "cells", "means",
    "missing": {variant: [cells it lacks]}, "records", "commits": {cell: commit}}. The cells may come from several
    commits, the variants of one cell (which it compares) from one."""
    recs = load_files(root, "record*.json", is_accuracy, "accuracy records", allow_mixed=True)
    unnamed = [r["file"] for r in recs if variant_of(r["record"]) not in VARIANTS or r["record"]["system"] != "clo"]
    if unnamed:
        raise RecordError(f"not a CLO record of a known +clo_ablation ({', '.join(VARIANTS)}): {names(unnamed)}")
    scores: dict[str, dict[str, float]] = {}
    hits: dict[str, dict[str, float]] = {}
    rows = []
    for r in recs:
        rec, v = r["record"], variant_of(r["record"])
        mine = scores_of(rec)
        twice = sorted(set(mine) & set(scores.get(v, {})))
        if twice:
            raise RecordError(f"{v} scores {', '.join(twice)} twice under {root} (one is {r['file']})")
        scores.setdefault(v, {}).update(mine)
        rows += [(cell, r["file"], commit_of(rec)) for cell in mine]
        hit = rec["cost_per_sample"].get("hit_rate")
        hits.setdefault(v, {}).update({cell: hit for cell in mine if hit is not None})
    variants = [v for v in VARIANTS if v in scores]
    cells = sorted(set.intersection(*(set(scores[v]) for v in variants)))
    if not cells:
        raise RecordError(f"no cell scored by every variant ({', '.join(variants)}) under {root}")
    means = {v: sum(scores[v][c] for c in cells) / len(cells) for v in variants}
    hit_rate = {v: sum(hits[v][c] for c in cells) / len(cells) for v in variants if all(c in hits[v] for c in cells)}
    missing = {v: sorted(set().union(*map(set, scores.values())) - set(scores[v])) for v in variants}
    commits = commit_per_cell(rows, root, "variants")
    return {
        "scores": scores,
        "hit_rate": hit_rate,
        "cells": cells,
        "means": means,
        "missing": missing,
        "records": recs,
        "commits": commits,
    }


def plot(root: Path, out: Path) -> dict:
    d = data(root)
    variants = list(d["means"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.bar(variants, [d["means"][v] for v in variants], color=[f"C{i}" for i in range(len(variants))])
    a.set_ylabel(f"mean score over {len(d['cells'])} cells")
    a.set_title("CLO accuracy by retriever and eta", fontsize=9)
    b.bar([v for v in variants if v in d["hit_rate"]], [d["hit_rate"][v] for v in variants if v in d["hit_rate"]])
    b.set_ylabel("real hit rate (mean over the cells)")
    b.set_ylim(0, 1)
    b.set_title("CLO's hit rate", fontsize=9)
    fig.suptitle("CLO's retriever and eta: accuracy and hit rate, SmolLM2-135M", fontsize=9)
    save(fig, out)
    return d


def table(root: Path, folder: str) -> str:
    """CLO's mean score and real hit rate per ablation variant over the cells every variant scored (the paper
    gives no numbers for these)."""
    d = data(root)
    rows = [[v, len(d["cells"]), m, d["hit_rate"].get(v)] for v, m in d["means"].items()]
    return md(["variant", "cells", "mean score", "real hit rate"], rows) + "\n\n" + source(folder, d["records"])


def main() -> None:
    args = plot_arguments(__doc__).parse_args()
    d = plot(args.root, args.out)
    print(f"{len(d['cells'])} cells scored by every variant: {', '.join(d['cells'])}")
    for v, m in d["means"].items():
        hit = d["hit_rate"].get(v)
        print(f"{v:<8} mean {m:.3f}" + (f"  hit rate {hit:.3f}" if hit is not None else ""))


if __name__ == "__main__":
    cli(main)
