"""What the GPU tests share (tests/test_gpu.py, test_uva_gpu.py, test_clo_gpu.py): the CUDA device, a tiny
model's shapes, and a CUDA KVSpec with the link measured."""

import torch

from experiments.runner.timing import link_gb_s
from kvoffload.kv.interface import KVSpec
from tests.tiny_models import tiny_config

CUDA = torch.device("cuda")
TINY = tiny_config(
    name="tiny",
    hidden_size=512,
    intermediate_size=1024,
    num_layers=4,
    num_heads=8,
    head_dim=64,
    vocab_size=2000,
    max_position_embeddings=4096,
)


def cuda_spec(*shape_and_dtype) -> KVSpec:
    """A CUDA KVSpec with the link measured, as the runner hands it to a system."""
    return KVSpec(*shape_and_dtype, CUDA, link_gb_s=link_gb_s(CUDA))
