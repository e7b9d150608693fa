"""experiments.producers.speculative_selection with real SmolLM2 weights: the exact top-k of the real query scores
recall 1, every other selection a fraction, and the speculative query really differs from the real one."""

import pytest
import torch
from hydra import compose, initialize_config_dir

from experiments.producers.speculative_selection import measure
from kvoffload.errors import ConfigError
from tests.test_config import CONF


def config(*overrides):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose(
            "config",
            overrides=["seqlen=1k", "workload.gen_tokens=3", "workload.stop_at_eos=false", "device=cpu", *overrides],
        )


@pytest.mark.slow
def test_selection_scores_against_the_exact_topk(smollm2_folder):
    rec = measure(config("system=clo"))
    per_head = {k: torch.tensor(v) for k, v in rec["per_head"].items()}
    sparse = slice(2, None)  # dense_layers = 2
    assert torch.equal(per_head["recall_exact_real"][sparse], torch.ones_like(per_head["recall_exact_real"][sparse]))
    for name, val in per_head.items():
        assert ((val[sparse] >= 0) & (val[sparse] <= 1)).all(), name
    assert per_head["recall_exact_speculative"][sparse].mean() < 1  # another query, another selection
    assert per_head["recall_hash_real"][sparse].mean() < 1  # the hash only approximates q . k
    # the first of the 3 tokens comes from the prefill: 2 decode steps
    assert rec["steps_per_head"] == 2 and rec["hard_heads"] == int(torch.tensor(rec["hard"])[sparse].sum())


def test_selection_needs_clo_settings():
    with pytest.raises(ConfigError, match="system=clo"):
        measure(config("system=fullattn"))
