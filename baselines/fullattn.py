"""FullAttn: every token's K/V stays in device memory and each decode step attends densely. The ideal where it
fits, run as the field runs it. On CUDA the default kernel is our length-from-device Triton kernel (capturable),
the fastest measured; `attention_backend=flashinfer` is flashinfer's batch decode over the cache read as pages
(baselines/paged_decode.py; tensor cores by default, its faster path), in eager steps and in a step captured in
a CUDA graph alike (planned once per step on the host, before the replay); `sdpa` torch SDPA (eager only: a step
captured in a graph then uses the Triton kernel). The cache is token-major ([layer, batch, token, kv_head, dim],
flashinfer's NHD), its token axis padded to whole pages, so that the first n tokens of a sequence are one
contiguous block."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from baselines.paged_decode import WORKSPACE_BYTES, PagedDecode, flashinfer_module, padded_len
from kvoffload.errors import ConfigError
from kvoffload.kernels import decode_attention as attention_kernels
from kvoffload.kernels.decode_attention import decode_attention
from kvoffload.kv.interface import KVOffloadSystem, KVSpec

BACKENDS = ("auto", "sdpa", "flashinfer", "triton")


def triton_runs() -> bool:
    return attention_kernels.triton is not None


def flashinfer_usable(spec: KVSpec) -> bool:
    return (
        spec.device.type == "cuda" and spec.dtype in (torch.bfloat16, torch.float16) and flashinfer_module() is not None
    )


class FullAttn(KVOffloadSystem):
    name = "fullattn"
    supports_cuda_graph = True

    def __init__(self, attention_backend: str = "auto", flashinfer_tensor_cores: bool = True) -> None:
        super().__init__()
        if attention_backend not in BACKENDS:
            raise ConfigError(f"attention_backend={attention_backend!r}; valid: {', '.join(BACKENDS)}")
        self.attention_backend = attention_backend
        self.tensor_cores = flashinfer_tensor_cores
        self.backend = "sdpa"
        self.paged: PagedDecode | None = None

    def resolve_backend(self, spec: KVSpec) -> str:
        fi = flashinfer_usable(spec)
        if self.attention_backend == "flashinfer" and not fi:
            raise ConfigError("attention_backend=flashinfer needs CUDA, bf16/fp16 and the flashinfer package")
        if self.attention_backend == "triton" and spec.device.type != "cuda":
            raise ConfigError("attention_backend=triton needs CUDA")
        if self.attention_backend != "auto":
            return self.attention_backend
        # the fastest measured (results/bench/decode_attention.json): our Triton kernel, within a few percent of
        # flashinfer's tensor-core batch decode at BSZ 1-16 and 32K-128K and ahead of its CUDA-core path
        return "triton" if spec.device.type == "cuda" and triton_runs() else "sdpa"

    def estimate_parts(self, spec: KVSpec) -> dict[str, int]:
        tokens = spec.batch * padded_len(spec.max_len) * spec.num_kv_heads
        workspace = WORKSPACE_BYTES if self.resolve_backend(spec) == "flashinfer" else 0
        return {"kv": spec.num_layers * tokens * spec.row_bytes, "workspace": workspace, "host": 0}

    def _allocate(self, spec: KVSpec) -> None:
        shape = (spec.num_layers, spec.batch, padded_len(spec.max_len), spec.num_kv_heads, spec.head_dim)
        self.k = torch.empty(shape, dtype=spec.dtype, device=spec.device)
        self.v = torch.empty(shape, dtype=spec.dtype, device=spec.device)
        self.backend = self.resolve_backend(spec)
        self.paged = None  # made at the first step, when it is known whether the step is captured

    def use_static_shapes(self) -> None:
        super().use_static_shapes()
        if self.backend == "sdpa":  # SDPA's launch depends on the length: not capturable
            self.backend = "triton"

    def begin_step(self) -> None:
        super().begin_step()
        if self.backend == "flashinfer":
            if self.paged is None:
                s = self.spec
                self.paged = PagedDecode(
                    s.batch,
                    s.max_len,
                    s.num_heads,
                    s.num_kv_heads,
                    s.head_dim,
                    s.dtype,
                    s.device,
                    graph=self.static_shapes,
                    tensor_cores=self.tensor_cores,
                )
            self.paged.plan(self.length + 1)

    def prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        t = k.shape[2]
        self.k[layer, :, :t] = k.transpose(1, 2)
        self.v[layer, :, :t] = v.transpose(1, 2)

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with self.phase("attention"):
            self.k[layer].index_copy_(1, self.position, k[:, None])
            self.v[layer].index_copy_(1, self.position, v[:, None])
            if self.backend == "flashinfer":
                return self.paged.run(q, self.k[layer], self.v[layer])
            if self.backend == "triton":
                # One launch for any length (read from the device): what a replayed CUDA graph needs.
                lengths = (self.position + 1).expand(q.shape[0])
                return decode_attention(q, self.k[layer], self.v[layer], lengths)
            end = self.length + 1
            keys, values = self.k[layer, :, :end], self.v[layer, :, :end]  # [B, T, Hkv, D]
            return dense_decode_attention(q, keys.transpose(1, 2), values.transpose(1, 2))

    def memory_parts(self) -> dict[str, int]:
        workspace = WORKSPACE_BYTES if self.backend == "flashinfer" else 0  # allocated at the first step
        return {"kv": self.k.nbytes + self.v.nbytes, "workspace": workspace, "host": 0}

    def describe(self) -> dict:
        kernel = {
            "flashinfer": "flashinfer BatchDecodeWithPagedKVCacheWrapper"
            + (" (tensor cores)" if self.tensor_cores else ""),
            "triton": "kvoffload.kernels.decode_attention (Triton, length from the device)",
            "sdpa": "torch scaled_dot_product_attention",
        }[self.backend]
        return {"attention_kernel": kernel, "attention_backend": self.backend, "memory_parts": self.memory_parts()}


# cuDNN's SDPA builds a plan per new key length, i.e. at every decode step: milliseconds each.
_DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def dense_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Decode attention through SDPA. q [B, H, D]; k, v [B, Hkv, T, D] (unit stride in D) -> [B, H, D].
    The G query heads of a KV head become G query rows of that head, so K/V are read once, not G times.
    mask [B, Hkv, 1, T] bool, when given: True where a key takes part (SDPA's boolean attn_mask)."""
    b, h, d = q.shape
    with sdpa_kernel(_DECODE_BACKENDS):
        o = F.scaled_dot_product_attention(q.view(b, k.shape[1], h // k.shape[1], d), k, v, attn_mask=mask)
    return o.reshape(b, h, d)
