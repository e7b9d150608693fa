"""Paper Table 5: accuracy on LongBench and RULER 16K-128K per system, one panel per model, with the paper's scores
(black ticks) over our bars. Reads the records of `python -m experiments.accuracy` (record.json: per task and length
a score; a sweep over tasks and lengths writes one per cell, merged here per model and system, a cell scored twice
refused) or summaries of the form

    {"experiment": "accuracy", "system": "clo", "model": "llama3",
     "scores": {"ruler_16k": 85.7, "niah_single_1@4k": 0.8, ...},  # task -> score, any task name
     "environment": {"git": {"commit": ...}, ...}, ...}

A task of the accuracy records is named <task>@<length in tokens>. The paper's score is drawn only for its own
tasks (paper.TAB5_TASKS: longbench, ruler_16k ... ruler_128k, 0-100).

    python -m plots.tab5_accuracy results/tab5_accuracy --out tab5.png
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from plots import paper  # noqa: E402
from plots.markdown import md, source  # noqa: E402
from plots.records import (  # noqa: E402
    SYSTEMS,
    RecordError,
    check_systems,
    cli,
    commit_of,
    commit_per_cell,
    load_files,
    names,
    plot_arguments,
    save,
)


def data(root: Path) -> dict:
    """{"scores": {(model, system): {task: score}}, "files": {(model, system): file}, "tasks", "records",
    "commits": {(model, task): commit}}. The records may come from several commits (a table filled in over
    sessions), but the systems of one cell, which it compares, must share one."""
    recs = load_files(root, "record*.json", is_accuracy, "accuracy records", allow_mixed=True)
    check_systems([(r["record"].get("system"), r["file"]) for r in recs], recs.root)
    scores, files, cell_file, rows = {}, {}, {}, []
    for r in recs:
        rec = r["record"]
        key = (rec["model"], rec["system"])
        mine = scores_of(rec)
        bad = sorted(t for t, v in mine.items() if not isinstance(v, (int, float)) or isinstance(v, bool))
        if bad:
            raise RecordError(f"scores of {', '.join(bad)} in {r['file']} are not numbers")
        for task in mine:
            if (key, task) in cell_file:
                raise RecordError(
                    f"two accuracy records of {key[1]} on {key[0]} score {task} under {root}: "
                    f"{cell_file[key, task]}, {r['file']}"
                )
            cell_file[key, task] = r["file"]
            rows.append(((key[0], task), r["file"], commit_of(rec)))
        scores.setdefault(key, {}).update(mine)
        files.setdefault(key, r["file"])
    commits = commit_per_cell(rows, root, "systems", lambda cell: f"{cell[1]} on {cell[0]}")
    seen = {t for s in scores.values() for t in s}
    tasks = [t for t in paper.TAB5_TASKS if t in seen] + sorted(seen - set(paper.TAB5_TASKS))
    if not tasks:
        raise RecordError(f"no scores in {names(recs.files)} under {root}")
    return {"scores": scores, "files": files, "tasks": tasks, "records": recs, "commits": commits}


HEADROOM = 0.2  # below this FullAttn score a cell cannot show what a sparse system loses: every system is at the floor


def headroom_cells(scores: dict, model: str) -> set[str]:
    """The tasks of `model` where FullAttn scores at least HEADROOM (on a 0-1 scale; the paper's 0-100 scores
    scaled): the cells that can tell the systems apart."""
    full = scores.get((model, "fullattn"), {})
    return {t for t, v in full.items() if v / (100 if t in paper.TAB5_TASKS else 1) >= HEADROOM}


def is_accuracy(rec: dict) -> bool:
    """A summary record, or a finished record of experiments.accuracy (its per-task, per-length results)."""
    return rec.get("experiment") == "accuracy" or (rec.get("status") == "ok" and isinstance(rec.get("tasks"), dict))


def scores_of(rec: dict) -> dict:
    """{task: score}; an experiments.accuracy record's task at a length is <task>@<tokens>."""
    if "scores" in rec:
        return rec["scores"]
    return {
        task if length == "all" else f"{task}@{length}": cell["score"]
        for task, by_length in rec["tasks"].items()
        for length, cell in by_length.items()
    }


def plot(root: Path, out: Path) -> dict:
    d = data(root)
    models = sorted({m for m, _ in d["scores"]})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        systems = [s for s in SYSTEMS if (model, s) in d["scores"]]
        w = 0.8 / len(systems)
        ref = paper.TAB5_SCORES.get(model, {})
        for j, s in enumerate(systems):
            xs = [i + (j - (len(systems) - 1) / 2) * w for i in range(len(d["tasks"]))]
            vals = [d["scores"][(model, s)].get(t, float("nan")) for t in d["tasks"]]
            ax.bar(xs, vals, width=w, color=f"C{list(SYSTEMS).index(s)}", label=SYSTEMS[s])
            ours_tasks = [(x, t) for x, t in zip(xs, d["tasks"]) if s in ref and t in paper.TAB5_TASKS]
            known = [(x, ref[s][paper.TAB5_TASKS.index(t)]) for x, t in ours_tasks]
            if known:
                ax.scatter(
                    *zip(*known), marker="_", s=200, color="black", zorder=3, label=paper.TAB5 if j == 0 else None
                )
        ax.set_xticks(range(len(d["tasks"])), d["tasks"], fontsize=8)
        ax.set_ylabel("score")
        ax.set_title(model, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle("Accuracy on long-context tasks by system", fontsize=9)
    save(fig, out)
    return d


def table(root: Path, folder: str) -> str:
    """Ours per cell, each marked where FullAttn itself scores below the headroom floor; the gap to FullAttn over
    the cells with headroom apart from the rest; the paper's Table 5 beside it, on its own models and tasks."""
    d = data(root)
    rows, gaps = [], []
    for (model, s), sc in sorted(d["scores"].items()):
        ref = paper.TAB5_SCORES.get(model, {}).get(s)
        room = headroom_cells(d["scores"], model)
        full = d["scores"].get((model, "fullattn"), {})
        for t in d["tasks"]:
            p = ref[paper.TAB5_TASKS.index(t)] if ref and t in paper.TAB5_TASKS else None
            mark = "yes" if t in room else "no headroom"
            rows.append([model, SYSTEMS[s], t, sc.get(t), mark, p, f"{sc[t] - p:+.2f}" if p and t in sc else None])
        if s != "fullattn":
            for label, cells in (("with headroom", room), ("without", set(full) - room)):
                both = sorted(c for c in cells if c in sc)
                if both:
                    gap = sum(full[c] - sc[c] for c in both) / len(both)
                    gaps.append([model, SYSTEMS[s], label, len(both), f"{gap:+.3f}"])
    ours = md(["model", "system", "task", "ours", "FullAttn >= 0.2", paper.TAB5, "ours - paper"], rows)
    gap_table = md(["model", "system", "cells", "n", "FullAttn - system (mean)"], gaps)
    paper_rows = [[m, SYSTEMS[s], *v] for m, by_system in paper.TAB5_SCORES.items() for s, v in by_system.items()]
    theirs = md(["model", "system", *paper.TAB5_TASKS], paper_rows)
    return (
        f"{ours}\n\nThe gap to FullAttn, over the cells where FullAttn scores at least {HEADROOM} "
        f"(the others are at the floor for every system) and over the rest:\n\n{gap_table}\n\n"
        f"{paper.TAB5} on its own models (Llama-3-8B, Qwen2.5-14B) and tasks (LongBench, RULER 16K-128K, 0-100): our "
        f"cells are SmolLM2-135M on RULER at 2K-8K, so no row of ours is a reproduction of a row of theirs; the "
        f"fidelity section measures what the small model can show.\n\n{theirs}\n\n" + source(folder, d["records"])
    )


def main() -> None:
    ap = plot_arguments(__doc__)
    args = ap.parse_args()
    for (model, s), sc in plot(args.root, args.out)["scores"].items():
        print(f"{model:<8} {s:<11} " + " ".join(f"{t} {v:.2f}" for t, v in sc.items()))


if __name__ == "__main__":
    cli(main)
