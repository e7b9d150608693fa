"""Importance-aware reuse thresholds (docs/systems.md, "Thresholds", Eq. 7-9); the GQA aggregation of Eq. 10 is
kvoffload.kernels.head_cache.aggregate_similarity. Pure tensor math
on [layers, kv_heads] tables: no model, no device state."""

from __future__ import annotations

import json
import math

import torch

from kvoffload.errors import ConfigError
from kvoffload.paths import ROOT, repo_path

DATA = ROOT / "data" / "head_importance"


def thresholds(importance: torch.Tensor, eta: float, n: float) -> torch.Tensor:
    """tau_i = cos(lambda_i * arccos(eta) + (1 - lambda_i) * pi), lambda_i = s_i ** n.
    s_i = 1 gives tau = eta (strict); s_i = 0 gives tau = -1 (always hit)."""
    if not -1.0 < eta <= 1.0:
        raise ConfigError(f"eta={eta} must lie in (-1, 1]")
    if n <= 0:
        raise ConfigError(f"n={n} must be positive")
    lam = importance.clamp(0.0, 1.0) ** n
    theta = lam * math.acos(eta) + (1.0 - lam) * math.pi
    return torch.cos(theta)


def load_importance(source: str, num_layers: int, num_kv_heads: int) -> tuple[torch.Tensor, str]:
    """[layers, kv_heads] scores in [0, 1] and a description for the record.
    source: 'uniform' | a folder name under data/head_importance | a path to a TSV in DuoAttention's layout
    (relative paths: from the repository root), e.g. a proxy of experiments.producers.head_importance, whose provenance
    (.json beside it) describes it."""
    if source == "uniform":
        return torch.ones(num_layers, num_kv_heads), "uniform (no importance scores: every head strict)"
    path = repo_path(source)
    if not path.is_file():
        path = DATA / source / "full_attention_heads.tsv"
    if not path.is_file():
        known = sorted(p.name for p in DATA.iterdir() if p.is_dir()) if DATA.is_dir() else []
        raise ConfigError(f"importance={source!r}: no such file; valid: uniform, a TSV path, or one of {known}")
    rows = [[float(x) for x in line.split()] for line in path.read_text().splitlines() if line.strip()]
    scores = torch.tensor(rows)
    if scores.shape != (num_layers, num_kv_heads):
        raise ConfigError(
            f"importance file {path.name} has shape {tuple(scores.shape)}, the model needs "
            f"({num_layers}, {num_kv_heads}) (layers, kv heads)"
        )
    about = path.with_suffix(".json")
    desc = json.loads(about.read_text()).get("description") if about.is_file() else None
    return scores.clamp(0.0, 1.0), desc or f"DuoAttention gates from {path.parent.name}/{path.name}"
