"""Model shapes. One dataclass covers the Llama and Qwen2 families; the yaml files in conf/model/ fill it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

FAMILIES = ("llama", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    family: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q/k/v projections
    rope_scaling: dict[str, Any] | None = field(default=None)  # Llama-3 style: factor, low/high_freq_factor, ...

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"model.family={self.family!r}; valid: {', '.join(FAMILIES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type", "llama3") != "llama3":
            raise ValueError(f"rope_scaling type {self.rope_scaling.get('rope_type')!r} is not supported (llama3 only)")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def num_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.attention_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in m.items() if k in known}
        if kwargs.get("rope_scaling") is not None:
            kwargs["rope_scaling"] = dict(kwargs["rope_scaling"])
        return cls(**kwargs)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], name: str = "hf") -> ModelConfig:
        """Build from a HuggingFace config.json dictionary."""
        model_type = hf.get("model_type", "llama")
        family = "qwen2" if model_type == "qwen2" else "llama"
        heads = hf["num_attention_heads"]
        # transformers >= 5 folds rope_theta and rope_scaling into one `rope_parameters` dict
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = hf.get("rope_theta", rope.pop("rope_theta", 10000.0))
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        return cls(
            name=name,
            family=family,
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads", heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            vocab_size=hf["vocab_size"],
            rope_theta=float(theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
            rope_scaling=scaling,
        )
