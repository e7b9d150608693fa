"""What lm-eval's tasks would download, and how an accuracy run does without it.

RULER's synthetic tasks build their samples locally (wonderwords' word lists ship with the package), but importing
lm-eval's `prepare_niah` calls `nltk.download("punkt_tab")` when NLTK has no punkt_tab model. We ship one
(`data/nltk/`, our own, see its README) and replace `nltk.download` by a refusal that names the missing resource.
Tasks whose data is a HF hub data set (LongBench, RULER's qa_*, the essay haystack) run only when that data set is
in the local HF cache; otherwise they are skipped with a message naming it."""

from __future__ import annotations

from kvoffload.errors import ConfigError
from kvoffload.paths import ROOT

NLTK_DATA = ROOT / "data" / "nltk"
# RULER tasks whose haystack is Paul Graham's essays (datasets.load_dataset("baber/paul_graham_essays"), not
# shipped: the essays are not ours to redistribute)
ESSAY_DATASET = "baber/paul_graham_essays"
ESSAY_TASKS = ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery")
# RULER's QA tasks fetch their JSON with `requests` on every run: no local copy can stand in for it
NETWORK_TASKS = {"ruler_qa_squad": "the SQuAD v2 dev set", "ruler_qa_hotpot": "the HotpotQA dev set"}


class MissingData(ConfigError):
    """A task's data is not on this machine and may not be downloaded."""


def refuse_download(info_or_id=None, *args, **kwargs):
    raise MissingData(
        f"nltk.download({info_or_id!r}) refused: no network at run time; put that NLTK resource under {NLTK_DATA}"
    )


def offline_nltk() -> None:
    """NLTK finds our punkt_tab after any of the user's own, and never downloads."""
    import nltk

    if str(NLTK_DATA) not in nltk.data.path:
        nltk.data.path.append(str(NLTK_DATA))
    nltk.download = refuse_download


def dataset_cached(path: str, name: str | None = None) -> bool:
    """Whether `datasets` can build this hub data set from the local cache alone (the environment is offline)."""
    import datasets

    try:
        datasets.load_dataset_builder(path, name or None)
    except Exception:  # noqa: BLE001 - offline, any failure means: not here
        return False
    return True


def missing_data(task: str, task_config: dict) -> str | None:
    """Why `task` cannot run offline (one line), or None when its data is here or made locally."""
    if task in NETWORK_TASKS:
        return f"{task}: skipped, lm-eval downloads {NETWORK_TASKS[task]} for it on every run and the run is offline"
    path = task_config.get("dataset_path") or ""
    if task in ESSAY_TASKS:
        path, name = ESSAY_DATASET, None
    elif path and not task_config.get("custom_dataset"):
        name = task_config.get("dataset_name") or None
    else:
        return None
    if dataset_cached(path, name):
        return None
    what = f"{path}" + (f" ({name})" if name else "")
    return f"{task}: skipped, its data set {what} is not in the local HF cache and the run is offline"
