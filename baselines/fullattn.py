"""FullAttn: every token's K/V stays in device memory and each decode step attends densely. The ideal where it
fits. Eager attention is flashinfer's decode kernel on CUDA when flashinfer is installed (bf16/fp16), torch
SDPA otherwise; a step replayed from a CUDA graph uses our length-from-device Triton kernel. The cache is
token-major ([layer, batch, token, kv_head, dim], flashinfer's NHD) so that the first
n tokens of a sequence are one contiguous block."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvoffload.errors import ConfigError
from kvoffload.kernels.decode_attention import decode_attention
from kvoffload.kv.interface import KVOffloadSystem, KVSpec


def _flashinfer():
    try:
        import flashinfer  # optional GPU extra

        return flashinfer
    except ImportError:
        return None


BACKENDS = ("auto", "sdpa", "flashinfer", "triton")


class FullAttn(KVOffloadSystem):
    name = "fullattn"
    supports_cuda_graph = True

    def __init__(self, attention_backend: str = "auto") -> None:
        super().__init__()
        if attention_backend not in BACKENDS:
            raise ConfigError(f"attention_backend={attention_backend!r}; valid: {', '.join(BACKENDS)}")
        self.attention_backend = attention_backend
        self.backend = "sdpa"

    def estimate_parts(self, spec: KVSpec) -> dict[str, int]:
        return {"kv": spec.num_layers * spec.layer_kv_bytes, "host": 0}

    def _allocate(self, spec: KVSpec) -> None:
        shape = (spec.num_layers, spec.batch, spec.max_len, spec.num_kv_heads, spec.head_dim)
        self.k = torch.empty(shape, dtype=spec.dtype, device=spec.device)
        self.v = torch.empty(shape, dtype=spec.dtype, device=spec.device)
        usable = spec.device.type == "cuda" and spec.dtype in (torch.bfloat16, torch.float16)
        fi = _flashinfer() if usable else None
        if self.attention_backend == "flashinfer" and fi is None:
            raise ConfigError("attention_backend=flashinfer needs CUDA, bf16/fp16 and the flashinfer package")
        if self.attention_backend == "triton" and spec.device.type != "cuda":
            raise ConfigError("attention_backend=triton needs CUDA")
        if self.attention_backend in ("sdpa", "triton"):
            self.backend = self.attention_backend
        else:
            self.backend = "flashinfer" if fi is not None else "sdpa"

    def prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        t = k.shape[2]
        self.k[layer, :, :t] = k.transpose(1, 2)
        self.v[layer, :, :t] = v.transpose(1, 2)

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with self.phase("attention"):
            self.k[layer].index_copy_(1, self.position, k[:, None])
            self.v[layer].index_copy_(1, self.position, v[:, None])
            if self.static_shapes or self.backend == "triton":
                # One launch for any length (read from the device): what a replayed CUDA graph needs.
                lengths = (self.position + 1).expand(q.shape[0])
                return decode_attention(q, self.k[layer], self.v[layer], lengths)
            end = self.length + 1
            keys, values = self.k[layer, :, :end], self.v[layer, :, :end]  # [B, T, Hkv, D]
            if self.backend == "flashinfer":
                import flashinfer

                return torch.stack(
                    [
                        flashinfer.single_decode_with_kv_cache(q[b], keys[b], values[b], kv_layout="NHD")
                        for b in range(q.shape[0])
                    ]
                )
            return dense_decode_attention(q, keys.transpose(1, 2), values.transpose(1, 2))

    def memory_parts(self) -> dict[str, int]:
        return {"kv": self.k.nbytes + self.v.nbytes, "host": 0}


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
