"""The small hand-built model shapes of the CPU and GPU tests, in one place: `tiny_config(**shapes)` is a Llama-family
ModelConfig whose defaults are the smallest shapes the tests use; a test names only the shapes it is about."""

from kvoffload.model.config import ModelConfig

DEFAULTS = dict(
    name="t",
    family="llama",
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    vocab_size=100,
    rope_theta=1e4,
    rms_norm_eps=1e-5,
    max_position_embeddings=512,
)


def tiny_config(**shapes) -> ModelConfig:
    """DEFAULTS with `shapes` over them; a qwen2 family has its q/k/v biases unless told otherwise."""
    cfg = {**DEFAULTS, **shapes}
    cfg.setdefault("attention_bias", cfg["family"] == "qwen2")
    return ModelConfig(**cfg)
