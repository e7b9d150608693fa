"""Paper Figures 4-6 with real weights: over a greedy decode, at every decode step, the cosine of each query head's
query with its own query one step earlier, and the overlap |S_t & S_t-1| / k of each KV head's exact top-k of
the prompt's middle between adjacent steps (the shared budget rule; scores summed over the query group, as
experiments/producers/reuse_profile.py measures them, whose record keeps only per-head summaries). Every sample is kept,
so a figure can draw the distributions (plots/fig4_6_similarity.py). Batch 1.

    python -m experiments.producers.fig4_6_similarity seqlen=4k workload.gen_tokens=64 workload.stop_at_eos=false \\
        device=cpu

Writes results/fig4_6_similarity_<model>/record.json (or +similarity_out=PATH); refuses an existing file unless
force=true.
"""

from __future__ import annotations

import sys
import time

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from experiments.producers.profile import decode_real
from experiments.producers.reuse_profile import ReuseProbe, budget_of
from experiments.runner import run_settings
from experiments.runner.records import environment, git_commit, refuse, write_measurement
from kvoffload.errors import ConfigError
from kvoffload.paths import ROOT, repo_path


def samples(probe: ReuseProbe, num_layers: int) -> tuple[list, list]:
    """(query_cos [L][H][steps-1] per query head, topk_overlap [L][Hkv][steps-1] per KV head), batch row 0."""
    cos, overlap = [], []
    for layer in range(num_layers):
        q = torch.stack([step_q for step_q, _ in probe.queries[layer]])[:, 0]  # [S, H, D]
        cos.append(torch.nn.functional.cosine_similarity(q[1:], q[:-1], dim=-1).T)  # [H, S-1]
        overlap.append(torch.stack(probe.samples["topk_overlap"][1][layer])[:, 0].T)  # [Hkv, S-1]
    return [[[round(v, 4) for v in head.tolist()] for head in x] for x in cos], [
        [[round(v, 4) for v in head.tolist()] for head in x] for x in overlap
    ]


def command_line(cfg: DictConfig) -> str:
    """This command as it was called (its Hydra overrides), for the record."""
    from hydra.core.hydra_config import HydraConfig

    try:
        overrides = " ".join(HydraConfig.get().overrides.task)
    except ValueError:  # not under @hydra.main (a test composing the config)
        overrides = "(composed by a caller)"
    return f"python -m experiments.producers.fig4_6_similarity {overrides}"


def measure(cfg: DictConfig, decode=decode_real) -> dict:
    """decode: experiments.producers.profile.decode_real (real weights only); tests hand in a tiny random model's."""
    if run_settings.integer(cfg.batch, "batch", 1) != 1:
        raise ConfigError("batch must be 1: the record keeps one sequence's steps")
    budget = budget_of(cfg)
    git = git_commit(ROOT)
    t0 = time.perf_counter()
    model_cfg, probe, desc = decode(
        cfg, lambda mc, prompt_len: ReuseProbe(mc, prompt_len, budget, lags=(1,), keep_queries=True), min_steps=3
    )
    cos, overlap = samples(probe, model_cfg.num_layers)
    return {
        "experiment": "fig4_6_similarity",
        "model": model_cfg.name,
        "source": desc,
        "shape": {"layers": model_cfg.num_layers, "heads": model_cfg.num_heads, "kv_heads": model_cfg.num_kv_heads},
        "budget": {**budget, "k": probe.k_sel, "middle_tokens": probe.n_mid},
        "decode_steps": len(probe.queries[0]),
        "query_cos": cos,
        "topk_overlap": overlap,
        "provenance": {"command": command_line(cfg), "git": git, "wall_s": round(time.perf_counter() - t0, 1)},
        "environment": environment(run_settings.resolve_device(cfg.device)),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }


def out_path(cfg: DictConfig):
    path = repo_path(cfg.get("similarity_out") or f"results/fig4_6_similarity_{cfg.model.name}/record.json")
    if path.exists() and not cfg.get("force", False):
        raise ConfigError(f"{path} exists: force=true overwrites it (or +similarity_out=another path)")
    return path


@hydra.main(config_path="../../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        path = out_path(cfg)
    except ConfigError as e:
        refuse(e)
    data, path = write_measurement(measure, cfg, lambda d: path)
    cos = torch.tensor(data["query_cos"])
    print(
        f"{cos.numel()} query cosines ({data['decode_steps']} steps): mean {cos.mean():.3f}, "
        f"{(cos > 0.8).float().mean() * 100:.0f}% above 0.8, {data['provenance']['wall_s']} s -> {path}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
