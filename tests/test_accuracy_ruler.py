"""RULER offline (experiments.accuracy): NLTK never downloads, tasks whose data is not here are skipped with a
message naming it, and a whole accuracy run (lm-eval's RULER data made locally, the real SmolLM2 weights) finishes
inside a network namespace with no network device at all."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from experiments.accuracy.offline import NLTK_DATA, MissingData, offline_nltk
from kvoffload.errors import ConfigError
from kvoffload.paths import ROOT

# lm-eval, its RULER data and the real SmolLM2 tokenizer and weights: end-to-end, left out of the fast loop
pytestmark = pytest.mark.slow

SIX = ["niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe"]


def no_network(cmd: list[str], env: dict, timeout: int) -> subprocess.CompletedProcess:
    """cmd in a new network namespace (only a loopback device, down): any download fails at once."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rn", "true"]).returncode != 0:
        pytest.skip("needs unshare -rn (user and network namespaces)")
    return subprocess.run(["unshare", "-rn", *cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_nltk_finds_punkt_tab_and_never_downloads():
    import nltk

    offline_nltk()
    assert str(NLTK_DATA) in nltk.data.path
    with pytest.raises(MissingData, match="punkt_tab"):
        nltk.download("punkt_tab")
    nltk.data.find("tokenizers/punkt_tab")  # what lm-eval's prepare_niah looks for on import (else it downloads)
    assert nltk.sent_tokenize("Mr. Smith went home. He slept.") == ["Mr. Smith went home.", "He slept."]


@pytest.fixture(scope="module")
def tm():
    from experiments.accuracy.tasks import index_for

    return index_for(["niah_single_1"])


def test_tasks_without_local_data_are_skipped_with_a_message(tm):
    from experiments.accuracy.tasks import check_tasks, index_for, is_ruler

    runnable, skipped = check_tasks(tm, [*SIX, "longbench_qasper", "ruler_qa_squad", "niah_single_2"])
    assert runnable == SIX and all(is_ruler(tm, t) for t in SIX) and not is_ruler(tm, "longbench_qasper")
    if any("longbench_qasper" in s for s in skipped):  # unless this machine's HF cache holds LongBench
        assert any("Xnhyacinth/LongBench (qasper) is not in the local HF cache" in s for s in skipped)
    assert any(s.startswith("ruler_qa_squad: skipped, lm-eval downloads") for s in skipped)
    assert any("niah_single_2" in s and "baber/paul_graham_essays" in s for s in skipped)
    with pytest.raises(ConfigError, match="did you mean niah_single_1"):
        check_tasks(tm, ["niah_singel_1"])
    with pytest.raises(ConfigError, match="not a task"):
        check_tasks(tm, ["ruler"])
    assert "arc_easy" not in tm.task_index and "arc_easy" in index_for(["arc_easy"]).task_index  # not in RULER's folder


def test_accuracy_run_without_network(tmp_path, smollm2_folder):
    """python -m experiments.accuracy, one RULER sample at 1K (2K and up: the measurement and the slow test),
    FullAttn, offline: the record holds the score, the sample and its cost."""
    env = {
        **os.environ,
        "CLO_CACHE": str(smollm2_folder.parent),
        "HF_HOME": str(tmp_path / "hf"),
        "PYTHONPATH": str(ROOT),
    }
    cmd = [sys.executable, "-m", "experiments.accuracy", "workload.tasks=[niah_single_1]", "workload.lengths=[1k]"]
    p = no_network([*cmd, "workload.limit=1", f"results_dir={tmp_path}", "wandb.enabled=false"], env, 600)
    assert p.returncode == 0, p.stderr[-3000:]
    (record,) = tmp_path.glob("*/record.json")
    rec = json.loads(record.read_text())
    r = rec["tasks"]["niah_single_1"]["1024"]
    (sample,) = r["samples"]
    assert rec["status"] == "ok" and r["n"] == 1 and r["score"] == sample["score"] in (0.0, 1.0)
    assert 700 < sample["cost"]["prompt_tokens"] <= 1024 - 128 and sample["cost"]["new_tokens"] <= 128
    assert rec["cost_per_sample"]["samples"] == 1 and rec["skipped"] == []


def test_six_ruler_tasks_generate_offline_at_2k_4k_8k(tmp_path, smollm2_folder):
    """Each task's 500 samples at each length, made with no network: every prompt within the length, every
    answer inside its prompt."""
    script = f"""
import experiments.accuracy, json
from lm_eval.tasks.ruler.common_utils import get_tokenizer
from experiments.accuracy.offline import offline_nltk
from experiments.accuracy.tasks import task_manager
offline_nltk()
tok = get_tokenizer({str(smollm2_folder)!r})
out = {{}}
for length in (2048, 4096, 8192):
    tm = task_manager({{"tokenizer": {str(smollm2_folder)!r}, "max_seq_lengths": [length]}})
    for name, task in tm.load({SIX!r})["tasks"].items():
        docs = list(task.test_docs())
        out[f"{{name}}@{{length}}"] = [len(docs), max(len(tok(d["input"]).input_ids) for d in docs),
                                       all(a in d["input"] for d in docs for a in d["outputs"])]
print(json.dumps(out))
"""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": str(ROOT)}
    p = no_network([sys.executable, "-c", script], env, 3000)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    for name in SIX:
        for length in (2048, 4096, 8192):
            n, longest, answers_inside = out[f"{name}@{length}"]  # longest prompt, in tokens
            assert n == 500 and longest <= length and answers_inside, (name, length, out[f"{name}@{length}"])


def test_a_second_evaluation_in_one_process_sees_the_same_samples(tm, smollm2_folder):
    """RULER's cwe draws from a module-level random.Random(42): without fresh_task_modules, every later evaluation
    in a process (the next system of a sweep) got other prompts for the same doc ids."""
    from lm_eval.api.model import LM

    from experiments.accuracy.tasks import evaluate, task_folder

    class Recorder(LM):
        def __init__(self):
            super().__init__()
            self.contexts = []

        def generate_until(self, requests, disable_tqdm=False):
            self.contexts += [r.args[0] for r in requests]
            return ["" for _ in requests]

        def loglikelihood(self, requests, disable_tqdm=False):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            raise NotImplementedError

    runs = [Recorder() for _ in range(2)]
    for lm in runs:
        evaluate(lm, "ruler_cwe", task_folder(tm, "ruler_cwe"), str(smollm2_folder), 2048, 2, False)
    assert len(runs[0].contexts) == 2 and runs[0].contexts == runs[1].contexts
