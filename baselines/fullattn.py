"""FullAttn: every token's K/V stays in device memory and each decode step attends densely. The ideal where it
fits. Attention is flashinfer's decode kernel on CUDA when flashinfer is installed, torch SDPA otherwise."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from clo.errors import ConfigError
from clo.kv.interface import KVOffloadSystem, KVSpec, MemoryEstimate


def _flashinfer():
    try:
        import flashinfer  # optional GPU extra

        return flashinfer
    except ImportError:
        return None


class FullAttn(KVOffloadSystem):
    name = "fullattn"

    def __init__(self, attention_backend: str = "auto") -> None:
        super().__init__()
        if attention_backend not in ("auto", "sdpa", "flashinfer"):
            raise ConfigError(f"attention_backend={attention_backend!r}; valid: auto, sdpa, flashinfer")
        self.attention_backend = attention_backend
        self.backend = "sdpa"

    def estimate_memory(self, spec: KVSpec) -> MemoryEstimate:
        kv = spec.num_layers * spec.layer_kv_bytes
        return MemoryEstimate(device_bytes=kv, host_bytes=0)

    def _allocate(self, spec: KVSpec) -> None:
        shape = (spec.num_layers, spec.batch, spec.num_kv_heads, spec.max_len, spec.head_dim)
        self.k = torch.empty(shape, dtype=spec.dtype, device=spec.device)
        self.v = torch.empty(shape, dtype=spec.dtype, device=spec.device)
        fi = _flashinfer() if spec.device.type == "cuda" else None
        if self.attention_backend == "flashinfer" and fi is None:
            raise ConfigError("attention_backend=flashinfer needs CUDA and the flashinfer package")
        self.backend = "flashinfer" if fi is not None and self.attention_backend != "sdpa" else "sdpa"

    def prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        t = k.shape[2]
        self.k[layer, :, :, :t] = k
        self.v[layer, :, :, :t] = v

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pos = self.length
        with self.phase("attention"):
            self.k[layer, :, :, pos] = k
            self.v[layer, :, :, pos] = v
            keys, values = self.k[layer, :, :, : pos + 1], self.v[layer, :, :, : pos + 1]
            if self.backend == "flashinfer":
                import flashinfer

                return torch.stack([
                    flashinfer.single_decode_with_kv_cache(q[b], keys[b], values[b], kv_layout="HND")
                    for b in range(q.shape[0])
                ])
            return dense_decode_attention(q, keys, values)

    def memory_held(self) -> MemoryEstimate:
        return MemoryEstimate(device_bytes=self.k.nbytes + self.v.nbytes, host_bytes=0)


def dense_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Reference decode attention. q [B, H, D]; k, v [B, Hkv, T, D] -> [B, H, D]."""
    o = F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)
    return o[:, :, 0]
