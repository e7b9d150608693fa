"""Means with bootstrap intervals over documents, alone and paired (two runs on the same documents and tokens)."""

from __future__ import annotations

import numpy as np

LEVEL = 0.95


def interval(values, resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): the mean of per-document values and its percentile bootstrap interval, documents
    resampled with replacement (a document's steps stay together: they share its context)."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        raise ValueError("no values")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, (resamples, x.size))].mean(axis=1)
    low, high = np.quantile(means, [(1 - LEVEL) / 2, 1 - (1 - LEVEL) / 2])
    return float(x.mean()), float(low), float(high)


def paired(a: dict[str, float], b: dict[str, float], resamples: int = 2000, seed: int = 0):
    """(mean, low, high) of a - b over the documents both have (by name), or None when they share none."""
    common = sorted(a.keys() & b.keys())
    if not common:
        return None
    return interval([a[d] - b[d] for d in common], resamples, seed)
