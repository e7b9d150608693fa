"""Head importance for a model without published DuoAttention gates (docs/workloads.md, "Head importance"): a documented
retrieval-head proxy, not DuoAttention's gate optimisation. Over greedy decodes of needle prompts with real weights,
per layer and KV head: the softmax attention mass each decode query puts on the prompt's middle, i.e. outside the
first `sink` and last `recent` prompt tokens (the tokens a streaming head would keep), averaged over the head's
query group, the steps and the prompts, then divided by the largest head's mass, so that the most retrieval-heavy
head scores 1 and a head that attends only to its sink and recent window scores 0 (DuoAttention's gates span the
same range: 1 = needs full attention). The softmax runs over the prompt's keys only: the few generated tokens count
as recent.

Writes data/head_importance/<model>-proxy.tsv (one row per layer, one column per KV head: the format of
Llama-3-8B-Instruct-Gradient-1048k/full_attention_heads.tsv, read by clo.policy.thresholds.load_importance) and its
provenance beside it (.json); refuses an existing file unless force=true.

    python -m experiments.producers.head_importance model=smollm2 seqlen=3k workload.gen_tokens=16 \\
        workload.stop_at_eos=false \\
        [+importance.seeds=[...] +importance.depths=[...]] [+importance_out=PATH] [force=true]
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from experiments.producers.profile import decode_real
from experiments.producers.train_hata import capture, command_line, settings
from experiments.runner import cli_checks, run_settings
from experiments.runner.records import environment, git_commit, refuse
from kvoffload.errors import ConfigError
from kvoffload.paths import ROOT, repo_path, write_json_atomic

DEFAULTS = {
    "seeds": [201, 202, 203, 204],
    "depths": [0.1, 0.35, 0.65, 0.9],
    "sink": 16,  # CLO's windows (conf/system/clo.yaml)
    "recent": 64,
}


def middle_mass(keys: torch.Tensor, queries: torch.Tensor, sink: int, recent: int) -> torch.Tensor:
    """keys [Hkv, T, D], queries [S, H, D] -> [Hkv]: the mean over steps and the group of the softmax attention
    (over the T prompt keys) on tokens [sink, T - recent)."""
    hkv, t, d = keys.shape
    q = queries.unflatten(1, (hkv, -1))  # [S, Hkv, G, D]
    attn = torch.softmax(torch.einsum("skgd,ktd->skgt", q, keys) / math.sqrt(d), -1)
    return attn[..., sink : t - recent].sum(-1).mean((0, 2))


def importance(samples, num_layers: int, sink: int, recent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (scores [L, Hkv] in [0, 1], the raw middle mass [L, Hkv])."""
    mass = torch.stack(
        [
            torch.stack([middle_mass(keys[layer], queries[layer], sink, recent) for keys, queries in samples]).mean(0)
            for layer in range(num_layers)
        ]
    )
    return mass / mass.max().clamp_min(1e-12), mass


def out_path(cfg: DictConfig) -> Path:
    return repo_path(cfg.get("importance_out") or f"data/head_importance/{cfg.model.name}-proxy.tsv")


def run(cfg: DictConfig, decode=decode_real) -> tuple[dict, Path]:
    s = settings(cfg, DEFAULTS, "importance")
    path = out_path(cfg)
    if path.exists() and run_settings.switch(cfg.force, "force") is not True:
        raise ConfigError(f"{path} exists: force=true overwrites it (or +importance_out=another path)")
    git = git_commit(ROOT)
    t0 = time.perf_counter()
    model_cfg, samples, descs = capture(cfg, list(zip(s["seeds"], s["depths"])), decode)
    scores, mass = importance(samples, model_cfg.num_layers, s["sink"], s["recent"])
    record = {
        "experiment": "head_importance",
        "model": model_cfg.name,
        "method": "proxy: decode attention mass outside the sink and recent windows on needle prompts, / its max",
        "description": f"retrieval-head proxy from experiments.producers.head_importance ({path.name}; "
        f"{len(descs)} needle prompts: attention mass outside sink {s['sink']} and recent {s['recent']}, divided by "
        "its max)",
        "settings": s,
        "prompts": descs,
        "scores": scores.tolist(),
        "middle_mass": mass.tolist(),
        "wall_s": round(time.perf_counter() - t0, 1),
        "provenance": {"command": command_line(cfg, "head_importance"), "git": git},
        "environment": environment(torch.device("cpu")),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join("\t".join(f"{x:.6f}" for x in row) + "\n" for row in scores.tolist()))
    tmp.replace(path)
    write_json_atomic(path.with_suffix(".json"), record)
    return record, path


@hydra.main(config_path="../../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        record, path = run(cfg)
    except ConfigError as e:
        refuse(e)
    s = torch.tensor(record["scores"])
    above = (s > 0.5).float().mean() * 100
    print(f"importance {tuple(s.shape)}: median {s.median():.3f}, {above:.0f}% above 0.5 -> {path}")


if __name__ == "__main__":
    cli_checks.refuse_unknown_keys(extra=("importance", "importance_out"))
    main()
