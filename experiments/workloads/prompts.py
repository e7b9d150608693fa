"""Prompts for the decode workload: a pass-key needle in a haystack (needs a tokenizer, scored), or uniform
random token ids (for synthetic weights, where text means nothing)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from kvoffload.errors import ConfigError

PROMPTS = ("auto", "needle", "random")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the pass key? Answer with the number only."


@dataclass
class Prompt:
    tokens: torch.Tensor  # [B, T]
    kind: str
    answer: str | None = None  # the pass key, for needle prompts
    meta: dict = field(default_factory=dict)


def build_prompt(
    kind: str, seqlen: int, batch: int, seed: int, tokenizer=None, vocab_size: int = 0, needle_depth: float = 0.5
) -> Prompt:
    if kind not in PROMPTS:
        raise ConfigError(f"workload.prompt={kind!r}; valid: {', '.join(PROMPTS)}")
    if kind == "auto":
        kind = "needle" if tokenizer is not None else "random"
    if kind == "random":
        gen = torch.Generator().manual_seed(seed)
        return Prompt(torch.randint(0, vocab_size, (batch, seqlen), generator=gen), "random")
    if tokenizer is None:
        raise ConfigError("workload.prompt=needle needs a tokenizer; synthetic weights have none (use prompt=random)")
    return needle_prompt(tokenizer, seqlen, batch, seed, needle_depth)


def _chat_ids(tokenizer, text: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
    return tokenizer(text)["input_ids"]


def needle_prompt(tokenizer, seqlen: int, batch: int, seed: int, depth: float) -> Prompt:
    """Exactly `seqlen` tokens: chat wrapper + haystack cut to fit, with the needle at `depth`."""
    if not 0.0 <= depth <= 1.0:
        raise ConfigError(f"workload.needle_depth={depth} must lie in [0, 1]")
    key = str(random.Random(seed).randint(10000, 99999))
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    intro = "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n"
    marker = "\u2063"  # placeholder where the haystack goes, so the chat wrapper is tokenised once
    wrapper = _chat_ids(tokenizer, intro + marker + "\n" + QUESTION)
    marker_ids = tokenizer(marker, add_special_tokens=False)["input_ids"]
    at = _find(wrapper, marker_ids)
    head, tail = wrapper[:at], wrapper[at + len(marker_ids) :]
    needle_ids = tokenizer(needle, add_special_tokens=False)["input_ids"]
    room = seqlen - len(head) - len(tail) - len(needle_ids)
    if room < 16:
        raise ConfigError(
            f"seqlen={seqlen} is too short for a needle prompt (needs at least {seqlen - room + 16} tokens)"
        )
    filler_ids = tokenizer(FILLER, add_special_tokens=False)["input_ids"]
    hay = (filler_ids * (room // len(filler_ids) + 1))[:room]
    cut = int(round(depth * room))
    ids = head + hay[:cut] + needle_ids + hay[cut:] + tail
    tokens = torch.tensor([ids] * batch, dtype=torch.long)
    return Prompt(tokens, "needle", answer=key, meta={"needle_depth": depth, "needle_token_index": len(head) + cut})


def _find(seq: list[int], sub: list[int]) -> int:
    for i in range(len(seq) - len(sub) + 1):
        if seq[i : i + len(sub)] == sub:
            return i
    raise ValueError("chat template changed the haystack placeholder; cannot build the needle prompt")
