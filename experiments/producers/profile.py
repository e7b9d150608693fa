"""Offline profile of query reuse (docs/systems.md, "Persistent heads and prefetch"): per layer and KV head, the mean
cosine similarity of a query head's query to its query one step earlier (s_hat_i), averaged over the head's query group
and the steps. Also the per-head distribution the paper plots (Fig. 4-6). Writes data/profiles/<model>.json, or
+profile_out=<path>; an existing file (data/profiles/smollm2.json is committed) is only replaced with force=true.

    python -m experiments.producers.profile model=smollm2 seqlen=3k workload.gen_tokens=64 workload.stop_at_eos=false \\
        +profile_out=/tmp/smollm2.json
"""

from __future__ import annotations

from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from baselines.fullattn import FullAttn
from experiments.runner import cli_checks, run_settings
from experiments.runner.execute import load_tokenizer
from experiments.runner.records import environment, refuse, write_measurement
from experiments.runner.run_settings import weights_source
from experiments.runner.timing import link_gb_s
from experiments.workloads.prompts import build_prompt
from kvoffload.errors import ConfigError
from kvoffload.generate import generate
from kvoffload.kv.interface import KVSpec
from kvoffload.model.config import ModelConfig
from kvoffload.model.weights import build_decoder
from kvoffload.paths import ROOT


class QueryRecorder(FullAttn):
    """FullAttn that keeps each decode step's query of every layer."""

    def __init__(self) -> None:
        super().__init__()
        self.queries: dict[int, list[torch.Tensor]] = {}

    def decode(self, layer, q, k, v):
        self.queries.setdefault(layer, []).append(q.float().cpu())
        return super().decode(layer, q, k, v)


def adjacent_similarity(queries: list[torch.Tensor], group: int) -> torch.Tensor:
    """[steps] of [B, H, D] -> cos(q_t, q_t-1) per step and KV head: [steps-1, B, Hkv] (group mean)."""
    q = torch.stack(queries)  # [S, B, H, D]
    cos = torch.nn.functional.cosine_similarity(q[1:], q[:-1], dim=-1)  # [S-1, B, H]
    return cos.unflatten(-1, (-1, group)).mean(-1)


def record_queries(cfg: DictConfig, min_steps: int = 3) -> tuple[ModelConfig, dict[int, list[torch.Tensor]], str]:
    """Greedy decode of the configured prompt with real weights; every step's query of every layer."""
    model_cfg, kv, desc = decode_real(cfg, lambda model_cfg, prompt_len: QueryRecorder(), min_steps)
    return model_cfg, kv.queries, desc


def decode_real(cfg: DictConfig, make_kv, min_steps: int = 3) -> tuple[ModelConfig, FullAttn, str]:
    """Greedy decode of the configured prompt with real weights through make_kv(model_cfg, prompt_len), a FullAttn
    that observes; returns it after the last step, with a description of the weights, prompt and steps."""
    model_cfg = ModelConfig.from_mapping(OmegaConf.to_container(cfg.model, resolve=True))
    source = weights_source(cfg.model)
    if source == "synthetic":
        raise ConfigError("profiling needs real weights (model.path=... or smollm2): synthetic queries mean nothing")
    numbers = run_settings.check_numbers(cfg)
    seqlen, gen, batch, seed = numbers.seqlen, numbers.gen_tokens, numbers.batch, numbers.seed
    if gen < min_steps:
        raise ConfigError(f"workload.gen_tokens must be at least {min_steps}")
    run_settings.check_length(model_cfg, seqlen, gen)
    device = run_settings.resolve_device(cfg.device)
    dtype = run_settings.resolve_dtype(cfg.dtype, device)
    tokenizer = load_tokenizer(source, cfg.model)
    prompt = build_prompt(
        cfg.workload.prompt, seqlen, batch, seed, tokenizer, model_cfg.vocab_size, numbers.needle_depth
    )
    model, weights_desc = build_decoder(model_cfg, source, cfg.model.get("path"), seed, device, dtype)
    kv = make_kv(model_cfg, seqlen)
    kv.allocate(
        KVSpec(
            model_cfg.num_layers,
            batch,
            seqlen + gen,
            model_cfg.num_heads,
            model_cfg.num_kv_heads,
            model_cfg.head_dim,
            dtype,
            device,
            link_gb_s=link_gb_s(device),
        )
    )
    generate(model, kv, prompt.tokens.to(device), gen)  # no early stop: every step is a sample
    desc = f"{weights_desc}; {prompt.kind} prompt of {seqlen} tokens, {gen} greedy steps, batch {batch}"
    return model_cfg, kv, desc


def profile(cfg: DictConfig) -> dict:
    model_cfg, queries, desc = record_queries(cfg)
    sims = torch.stack(
        [adjacent_similarity(queries[layer], model_cfg.group_size) for layer in range(model_cfg.num_layers)]
    )  # [L, S-1, B, Hkv]
    per_head = sims.flatten(1, 2)  # [L, samples, Hkv]
    return {
        "model": model_cfg.name,
        "source": desc,
        "s_hat": per_head.mean(1).tolist(),
        "std": per_head.std(1).tolist(),
        "fraction_above_0.8": (per_head > 0.8).float().mean(1).tolist(),
        "quantiles": {str(p): per_head.quantile(p, dim=1).tolist() for p in (0.1, 0.5, 0.9)},
        "environment": environment(run_settings.resolve_device(cfg.device)),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }


def output_path(cfg: DictConfig) -> Path:
    """Where the profile goes: +profile_out, else data/profiles/<model>.json. An existing file is refused (a
    ConfigError, before any work) unless force=true: the committed profiles are inputs of CLO's runs."""
    out = Path(cfg.get("profile_out") or ROOT / "data" / "profiles" / f"{cfg.model.name}.json")
    if out.exists() and run_settings.switch(cfg.force, "force") is not True:
        raise ConfigError(f"{out} exists; force=true overwrites it, or +profile_out=<another path> writes elsewhere")
    return out


@hydra.main(config_path="../../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        out = output_path(cfg)
    except ConfigError as e:
        refuse(e)
    data, out = write_measurement(profile, cfg, lambda d: out)
    s = torch.tensor(data["s_hat"])
    print(
        f"s_hat over {s.numel()} heads: mean {s.mean():.3f}, min {s.min():.3f}, "
        f"{(s > 0.8).float().mean() * 100:.0f}% above 0.8 -> {out}"
    )


if __name__ == "__main__":
    cli_checks.refuse_unknown_keys(extra=("profile_out",))
    main()
