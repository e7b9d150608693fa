"""Every config group composes, every system instantiates, and the sequence-length syntax parses."""
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from kvoffload.errors import ConfigError
from kvoffload.kv.interface import KVOffloadSystem
from kvoffload.model.config import ModelConfig
from experiments.preflight import parse_tokens

CONF = Path(__file__).resolve().parent.parent / "conf"


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("model", options("model"))
@pytest.mark.parametrize("system", options("system"))
@pytest.mark.parametrize("workload", options("workload"))
def test_every_combination_composes(model, system, workload):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"model={model}", f"system={system}", f"workload={workload}",
                                           "seqlen=128k"])
    mc = ModelConfig.from_mapping(cfg.model)
    assert mc.name == model and mc.num_heads % mc.num_kv_heads == 0
    assert isinstance(instantiate(cfg.system), KVOffloadSystem)
    assert parse_tokens(cfg.seqlen) == 131072


def test_paper_model_shapes():
    with initialize_config_dir(str(CONF), version_base="1.3"):
        llama = ModelConfig.from_mapping(compose("config", overrides=["model=llama3"]).model)
        qwen = ModelConfig.from_mapping(compose("config", overrides=["model=qwen25"]).model)
    assert (llama.num_layers, llama.num_heads, llama.num_kv_heads, llama.head_dim) == (32, 32, 8, 128)
    assert (qwen.num_layers, qwen.num_heads, qwen.num_kv_heads, qwen.head_dim) == (48, 40, 8, 128)
    assert llama.kv_bytes_per_token(2) == 128 * 1024  # hardware.md: 128 KiB per token
    assert qwen.kv_bytes_per_token(2) == 192 * 1024
    assert 7.9e9 < llama.num_params < 8.1e9 and 14.6e9 < qwen.num_params < 14.9e9


@pytest.mark.parametrize("text,tokens", [(4096, 4096), ("4096", 4096), ("4k", 4096), ("128k", 131072),
                                         ("128K", 131072), ("1m", 1048576), ("0.5k", 512)])
def test_parse_tokens(text, tokens):
    assert parse_tokens(text) == tokens


@pytest.mark.parametrize("bad", ["lots", "12q", "-4k", 0, ""])
def test_parse_tokens_rejects(bad):
    with pytest.raises(ConfigError):
        parse_tokens(bad)
