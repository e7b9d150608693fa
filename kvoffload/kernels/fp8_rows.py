"""FP8 host rows (docs/fp8.md): K and V of one token of one KV head in FP8 e4m3, each half with its own scale,
packed into one row of bytes so that every transfer path (the UVA gather, the CPU gather, block copies) moves it as
it moves a model-dtype row: bits, unchanged.

  packed  [..., 2, D + SCALE_BYTES] uint8: per half (K, then V) D bytes of e4m3 values, then its fp16 scale

A half's scale is absmax / 448 (e4m3's largest finite value), rounded to fp16 and clamped at fp16's smallest normal
so that a zero half quantises to zeros, never to a division by zero; value = e4m3 * scale. The scale lies beside its
values, so a gathered row carries everything attention needs to dequantise it, and the row's bytes (2 * (D + 2): 260
for D = 128, against 512 in bf16) are what plans and memory checks count.

`quantize_rows` and `dequantize_rows` are plain torch (the CPU's path and the references of the Triton kernels);
`fp8_halves` gives views of the values (as float8) and scales (as fp16) that a kernel reads in place.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # e4m3fn's largest finite value
SCALE_DTYPE = torch.float16
SCALE_BYTES = 2
# fp16's smallest normal: a half whose absmax is below 448 x this keeps this scale (its values round near zero)
MIN_SCALE = 2.0**-14


def fp8_dtype() -> torch.dtype | None:
    """torch's e4m3 dtype, None on a build without float8."""
    return getattr(torch, "float8_e4m3fn", None)


def packed_width(head_dim: int) -> int:
    """Bytes of one half (K or V) of a packed row."""
    return head_dim + SCALE_BYTES


def quantize_rows(kv: torch.Tensor) -> torch.Tensor:
    """kv [..., 2, D] (any float dtype) -> packed [..., 2, D + SCALE_BYTES] uint8 on kv's device."""
    d = kv.shape[-1]
    x = kv.float()
    scale = (x.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE).to(SCALE_DTYPE)
    # the fp16 scale can round below absmax / 448: the clamp keeps the largest value finite
    values = (x / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(fp8_dtype())
    out = torch.empty(*kv.shape[:-1], packed_width(d), dtype=torch.uint8, device=kv.device)
    out[..., :d] = values.view(torch.uint8)
    out[..., d:] = scale.view(torch.uint8)
    return out


def fp8_halves(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """packed [..., 2, D + SCALE_BYTES] uint8 -> (values [..., 2, D] float8 view, scales [..., 2] fp16 view): no copy.
    The scales' view needs their byte offset and every stride above the row even (an even D; a packed buffer's)."""
    d = packed.shape[-1] - SCALE_BYTES
    return packed[..., :d].view(fp8_dtype()), packed[..., d:].view(SCALE_DTYPE)[..., 0]


def dequantize_rows(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """packed [..., 2, D + SCALE_BYTES] -> [..., 2, D] in dtype: e4m3 * scale, in fp32 then rounded once."""
    values, scales = fp8_halves(packed)
    return (values.float() * scales.float()[..., None]).to(dtype)
