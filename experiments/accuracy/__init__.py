"""Accuracy of a KV system: lm-eval tasks (RULER, LongBench, any generate_until or loglikelihood task) run through
our decoder with any system. `lm.py` is the lm-eval model (registered as `clo`), `__main__.py` the Hydra command
(`python -m experiments.accuracy`), `lm_eval_cli.py` lm-eval's own command line with that model registered.

Importing this package turns the HF hub, datasets and transformers offline: an accuracy run never reaches the
network (`offline.py` also keeps lm-eval's RULER tasks from downloading NLTK data). It must be imported before
any of those libraries is, as its entry points do: they read the switches when first imported."""

import os

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
os.environ.update(OFFLINE_ENV)
