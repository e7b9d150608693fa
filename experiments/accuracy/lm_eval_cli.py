"""lm-eval's own command line, offline, with the `clo` model registered (lm-eval finds a model only once the module
that registers it is imported, which its `lm-eval` script does not do):

    python -m experiments.accuracy.lm_eval_cli run --model clo --model_args system=clo system.eta=0.7 \\
        --tasks niah_single_1 ruler_vt --metadata max_seq_lengths=[2048] --limit 5 --device cpu

Every `--model_args` entry is a Hydra override over conf/ (experiments.accuracy.config). RULER's tasks size their
samples with a tokenizer named in the metadata: for `--model clo` without one, the model's own tokenizer folder is
added. For `--model clo` the results go into `--output_path` itself (lm-eval would add a folder named after a
`pretrained=` argument, which clo has not, so a random one), and RULER's placeholder scores of the lengths not run
(-1, no stderr) are left out of the results and the table. Any other of lm-eval's models and options work as with
`lm-eval` itself."""

from __future__ import annotations

import sys

from experiments.accuracy.offline import offline_nltk
from experiments.runner.records import refuse
from kvoffload.errors import ConfigError


def tokenizer_folder(model_args: dict) -> str:
    """The tokenizer folder of the model that these model args choose."""
    from experiments.accuracy.config import compose_config, override_text
    from kvoffload.model.weights import smollm2_folder

    cfg, _ = compose_config([override_text(k, v) for k, v in model_args.items() if k not in LM_EVAL_ARGS])
    return str(smollm2_folder()) if not cfg.model.get("path") else str(cfg.model.path)


LM_EVAL_ARGS = ("batch_size", "max_batch_size", "device", "max_length", "tokenizer", "trust_remote_code")
# RULER scores every default length a task was not run at -1, "no samples" (lm_eval/tasks/ruler/common_utils.py)
NO_SAMPLES = -1


def without_lengths_not_run(results: dict) -> dict:
    """lm-eval's results without RULER's -1 metrics (and their N/A stderr): lengths that no sample had."""
    for section in ("results", "groups"):
        for metrics in results.get(section, {}).values():
            for key in [k for k, v in metrics.items() if v == NO_SAMPLES and "," in k and "_stderr" not in k]:
                metric, _, flt = key.partition(",")
                metrics.pop(key)
                metrics.pop(f"{metric}_stderr,{flt}", None)
    return results


def clo_evaluate(simple_evaluate, model: str):
    """lm-eval's simple_evaluate, its results without the lengths not run, and its tracker set to save into
    --output_path itself under the model's name `model` (it logged a random name: clo has no `pretrained=`)."""

    def evaluate(*args, **kwargs):
        results = simple_evaluate(*args, **kwargs)
        tracker = kwargs.get("evaluation_tracker")
        if tracker is not None:
            tracker.general_config_tracker.model_name = model
            tracker.general_config_tracker.model_name_sanitized = ""  # output_path / "": no folder of its own
        return without_lengths_not_run(results) if results is not None else None

    return evaluate


def main() -> None:
    import lm_eval
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    import experiments.accuracy.lm  # noqa: F401 - registers `clo`

    offline_nltk()
    setup_logging()
    parser = HarnessCLI()
    args = parser.parse_args()
    try:
        if getattr(args, "model", None) == "clo":
            model_args = args.model_args or {}
            args.metadata = args.metadata or {}
            if "tokenizer" not in args.metadata and "tokenizer" not in model_args:
                args.metadata["tokenizer"] = tokenizer_folder(model_args)
            # lm-eval's run imports simple_evaluate from the package when it runs: this one is taken
            lm_eval.simple_evaluate = clo_evaluate(lm_eval.simple_evaluate, "clo")
        parser.execute(args)
    except ConfigError as e:
        refuse(e)


if __name__ == "__main__":
    sys.exit(main())
