"""The lm-eval side of an accuracy run: which tasks exist and can run offline, and one evaluation of one task (at one
RULER length) with our model. RULER's tasks read the tokenizer that sizes their samples and the lengths they are
sized to from the task metadata (`{"tokenizer": <folder>, "max_seq_lengths": [L]}`); each length is evaluated on
its own so that `limit` counts samples per length. A RULER sample's score is its metric named after its length."""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

from experiments.accuracy.offline import missing_data, offline_nltk
from kvoffload.errors import ConfigError

_MANAGERS: dict[str, object] = {}


def task_manager(metadata: dict, folders: tuple[str, ...] = ()):
    """lm-eval's TaskManager with this metadata: over all its built-in tasks (indexing them takes seconds: once per
    process), or over only these task folders."""
    from lm_eval.tasks import TaskManager

    key = repr((sorted(metadata.items()), folders))
    if key not in _MANAGERS:
        only = {"include_path": list(folders), "include_defaults": False} if folders else {}
        _MANAGERS[key] = TaskManager(metadata=metadata, **only)
    return _MANAGERS[key]


# lm-eval's task folders indexed first (in a second, where all of its tasks take several): the paper's benchmarks
FIRST_FOLDERS = ("ruler", "longbench")


def index_for(names: list[str]):
    """A TaskManager that knows `names`: over FIRST_FOLDERS when they hold them all, else over every task."""
    import lm_eval.tasks

    root = Path(lm_eval.tasks.__file__).parent
    tm = task_manager({}, tuple(str(root / f) for f in FIRST_FOLDERS))
    return tm if all(n in tm.task_index for n in names) else task_manager({})


def task_folder(tm, task: str) -> str:
    return str(Path(tm.task_index[task].yaml_path).parent)


def is_ruler(tm, task: str) -> bool:
    entry = tm.task_index.get(task)
    return entry is not None and entry.yaml_path is not None and Path(entry.yaml_path).parent.name == "ruler"


def task_config(tm, task: str) -> dict:
    """The task's yaml as written (functions unresolved, includes merged)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    entry = tm.task_index[task]
    return load_yaml(entry.yaml_path, resolve_func=False) if entry.yaml_path else dict(entry.cfg or {})


def check_tasks(tm, names: list[str]) -> tuple[list[str], list[str]]:
    """(the tasks that can run here, a one-line message for each that is skipped). An unknown name, or a group
    (name its tasks instead), is a ConfigError."""
    from lm_eval.tasks._index import Kind

    runnable, skipped = [], []
    for name in names:
        entry = tm.task_index.get(name)
        if entry is None:
            near = difflib.get_close_matches(name, tm.all_tasks, n=3)
            raise ConfigError(
                f"workload.tasks: no lm-eval task {name!r}" + (f" (did you mean {', '.join(near)}?)" if near else "")
            )
        if entry.kind not in (Kind.TASK, Kind.PY_TASK):
            raise ConfigError(f"workload.tasks: {name!r} is a {entry.kind.name.lower()}, not a task: name its tasks")
        why = missing_data(name, task_config(tm, name))
        (skipped if why else runnable).append(why or name)
    return runnable, skipped


def fresh_task_modules() -> None:
    """Forget the task helper modules lm-eval's YAML loader keeps in sys.modules, so that the next evaluation runs
    them afresh. RULER's cwe_utils draws its word lists from a module-level random.Random(42): kept, a second
    evaluation in the same process continues that generator and builds other prompts, so the systems of a sweep
    would not see the same samples (simple_evaluate reseeds only the global generators)."""
    for name in [n for n, m in sys.modules.items() if n.startswith("lm_eval.tasks.") and hasattr(m, "__mtime__")]:
        del sys.modules[name]


def evaluate(lm, task: str, folder: str, tokenizer: str, length: int | None, limit: int | None, chat: bool) -> dict:
    """One lm-eval run of `task` (its yaml in `folder`; at RULER length `length`) with model `lm`; its score and its
    samples. The same task, length and limit give the same samples whatever ran before in the process."""
    from lm_eval import simple_evaluate

    offline_nltk()
    fresh_task_modules()
    metadata = {"tokenizer": tokenizer} | ({"max_seq_lengths": [length]} if length else {})
    out = simple_evaluate(
        model=lm,
        tasks=[task],
        limit=limit,
        task_manager=task_manager(metadata, (folder,)),
        log_samples=True,
        bootstrap_iters=0,
        apply_chat_template=chat,
    )
    samples = []
    for s in out["samples"][task]:
        metrics = {m: s[m] for m in s["metrics"] if m in s}
        score = metrics.get(str(length)) if length else None
        samples.append(
            {
                "doc_id": s["doc_id"],
                "target": s["target"],
                "response": s["filtered_resps"],
                "score": score,
                "metrics": metrics,
            }
        )
    scores = [s["score"] for s in samples if s["score"] is not None]
    results = {k: v for k, v in out["results"][task].items() if k != "alias"}
    return {
        "score": sum(scores) / len(scores) if scores else None,
        "n": len(samples),
        "results": results if not length else {str(length): results.get(f"{length},none")},
        "samples": samples,
    }
