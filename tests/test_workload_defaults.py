"""The headline command runs the paper's configuration: a paper-shape model on synthetic weights brings its
reuse profile and its synthetic query process without any bundle; real weights keep their own queries."""

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from experiments.runner.execute import resolve_queries
from kvoffload.paths import ROOT


def composed(*overrides):
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize("model", ["llama3", "qwen25"])
def test_paper_models_bring_their_profile_and_queries(model):
    cfg = composed(f"model={model}", "system=clo")
    assert cfg.system.profile == cfg.model.reuse_profile == f"data/profiles/{model}-from-smollm2-reuse.json"
    assert (ROOT / cfg.model.reuse_profile).is_file()
    assert resolve_queries(cfg.workload.query_process, "synthetic", cfg.model) == cfg.model.synthetic_queries
    # the same model with a real checkpoint keeps the model's own queries
    assert resolve_queries(cfg.workload.query_process, "hf", cfg.model) == "model"


def test_real_smollm2_keeps_its_queries_and_explicit_settings_win():
    cfg = composed()
    assert resolve_queries(cfg.workload.query_process, "smollm2-gguf", cfg.model) == "model"
    assert resolve_queries("model", "synthetic", cfg.model) == "model"
    assert resolve_queries("x.json", "smollm2-gguf", cfg.model) == "x.json"
    assert resolve_queries("auto", "synthetic", OmegaConf.create({})) == "model"
