"""lm-eval's own command line, offline, with the `clo` model registered (lm-eval finds a model only once the module
that registers it is imported, which its `lm-eval` script does not do):

    python -m experiments.accuracy.lm_eval_cli run --model clo --model_args system=clo system.eta=0.7 \\
        --tasks niah_single_1 ruler_vt --metadata max_seq_lengths=[2048] --limit 5 --device cpu

Every `--model_args` entry is a Hydra override over conf/ (experiments.accuracy.config). RULER's tasks size their
samples with a tokenizer named in the metadata: for `--model clo` without one, the model's own tokenizer folder is
added. Any other of lm-eval's models and options work as with `lm-eval` itself."""

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


def main() -> None:
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
        parser.execute(args)
    except ConfigError as e:
        refuse(e)


if __name__ == "__main__":
    sys.exit(main())
