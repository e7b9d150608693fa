"""The budget rule every sparse system shares: how a prompt splits into an always-attended sink and recent
window and a middle that is retrieved, and how many middle tokens each KV head attends. One rule, so that
every system attends the same number of tokens."""

from __future__ import annotations

import math

from kvoffload.errors import ConfigError


def split_prompt(prompt_len: int, sink: int, recent: int) -> tuple[int, int, int]:
    """(sink, recent, middle) token counts: sink and recent are always attended, the middle is retrieved."""
    s = min(sink, prompt_len)
    r = min(recent, prompt_len - s)
    return s, r, prompt_len - s - r


def check_budget(topk_ratio: float, sink: int, recent: int, dense_layers: int) -> None:
    """The settings every sparse system shares, refused before any work."""
    if not 0.0 < topk_ratio <= 1.0:
        raise ConfigError(f"topk_ratio={topk_ratio}: top-k must be a fraction of the context in (0, 1]")
    negative = [f"{k}={v}" for k, v in (("sink", sink), ("recent", recent), ("dense_layers", dense_layers)) if v < 0]
    if negative:
        raise ConfigError(f"{', '.join(negative)}: sink, recent and dense_layers must be >= 0")


def select_budget(prompt_len: int, topk_ratio: float, sink: int, recent: int) -> int:
    """Middle tokens each KV head attends: ceil(topk_ratio * prompt) in all, sink and recent counted in it. The
    one budget rule of every sparse system, so that they attend the same number of tokens."""
    s, r, n_mid = split_prompt(prompt_len, sink, recent)
    return max(min(math.ceil(topk_ratio * prompt_len) - s - r, n_mid), 0)
