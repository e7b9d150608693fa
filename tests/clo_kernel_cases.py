"""The inputs CLO's kernel tests share (tests/test_clo_kernels.py, test_clo_select_kernels.py): random cases for the
UVA gather, the hash scores and the head-cache lookup, and the marker that runs a test only in Triton's interpreter
(TRITON_INTERPRET=1)."""

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpreter = pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1 to run the kernels on the CPU")


# ---- inputs ------------------------------------------------------------------------------------------------
def gather_case(b, hkv, t, d, h, k, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    host = torch.randn(b, hkv, t, 2, d, generator=g).to(dtype)
    if device == "cuda":
        host = host.pin_memory()
    heads = torch.randperm(hkv, generator=g)[:h].to(device)
    idx = torch.stack([torch.stack([torch.randperm(t, generator=g)[:k] for _ in range(h)]) for _ in range(b)])
    miss = torch.rand(b, h, generator=g) < 0.5
    miss[0, 0] = True
    slots = torch.randn(b, h, k, 2, d, generator=g).to(dtype)
    return host, heads, idx.to(device), miss.to(device), slots.to(device)


def hash_case(b, hk, h, t, g_, rbit, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (b, hk, t, rbit // 8), generator=gen, dtype=torch.uint8)
    norms = torch.rand(b, hk, t, generator=gen) * 10
    qcodes = torch.randint(0, 256, (b, h, g_, rbit // 8), generator=gen, dtype=torch.uint8)
    heads = torch.randperm(hk, generator=gen)[:h]
    return codes.to(device), norms.to(device), qcodes.to(device), heads.to(device)


def lookup_case(b, hc, g_, d, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hc, g_, d, generator=gen)
    # labels near q for some heads, unrelated for others, so both hits and misses occur
    labels = torch.where(
        torch.rand(b, hc, 1, 1, generator=gen) < 0.5,
        q + 0.3 * torch.randn(q.shape, generator=gen),
        torch.randn(q.shape, generator=gen),
    )
    labels[0, 0] = 0.0  # an empty slot's label: cos = 0, as torch.cosine_similarity with eps
    valid = torch.rand(b, hc, generator=gen) < 0.8
    tau = torch.rand(hc, generator=gen) * 1.6 - 0.6
    weights = torch.rand(hc, g_, generator=gen)
    weights[0] = 0.0  # all-zero importance: a plain mean
    force = torch.rand(hc, generator=gen) < 0.2
    return tuple(x.to(device) for x in (q.to(dtype), labels, valid, tau, weights, force))
