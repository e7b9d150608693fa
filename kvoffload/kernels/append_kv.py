"""A decode step's new K/V row into a layer's window, in one launch.

  k, v    [B, Hkv, D]          the step's new key and value (model head order)
  window  [B, Hkv, T, 2, D]    the layer's window, its heads in the store's order
  order   [Hkv] long           window head j holds model head order[j]
  at      [1] long             the window row to write (on the device: one launch serves every step of a graph)

`append_kv_ref` is the specification (three torch kernels: stack, the head permutation, index_copy); on CUDA
`append_kv` is one Triton program per (sequence, head): one launch on a layer's critical path instead of three.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: the reference is used
    triton = None


def append_kv_ref(
    k: torch.Tensor, v: torch.Tensor, window: torch.Tensor, order: torch.Tensor, at: torch.Tensor
) -> None:
    window.index_copy_(2, at, torch.stack([k, v], dim=2)[:, order, None])


if triton is not None:

    @triton.jit
    def _append_kv_kernel(
        K,
        V,
        W,
        Order,
        At,
        stride_kb,
        stride_kh,
        stride_vb,
        stride_vh,
        stride_wb,
        stride_wh,
        stride_wt,
        stride_wkv,
        HKV: tl.constexpr,
        D: tl.constexpr,
    ):
        b = tl.program_id(0) // HKV
        j = tl.program_id(0) % HKV
        src = tl.load(Order + j)
        row = tl.load(At)
        d = tl.arange(0, D)
        dst = W + b.to(tl.int64) * stride_wb + j * stride_wh + row * stride_wt + d
        tl.store(dst, tl.load(K + b * stride_kb + src * stride_kh + d))
        tl.store(dst + stride_wkv, tl.load(V + b * stride_vb + src * stride_vh + d))


def append_kv_triton(
    k: torch.Tensor, v: torch.Tensor, window: torch.Tensor, order: torch.Tensor, at: torch.Tensor
) -> None:
    b, hkv, d = k.shape
    assert d & (d - 1) == 0 and k.stride(2) == v.stride(2) == window.stride(4) == 1
    assert window.dtype == k.dtype == v.dtype and window.shape[1] == hkv == order.shape[0]
    _append_kv_kernel[(b * hkv,)](
        k,
        v,
        window,
        order,
        at,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        window.stride(0),
        window.stride(1),
        window.stride(2),
        window.stride(3),
        HKV=hkv,
        D=d,
    )


def append_kv(k: torch.Tensor, v: torch.Tensor, window: torch.Tensor, order: torch.Tensor, at: torch.Tensor) -> None:
    if window.is_cuda and triton is not None and k.shape[-1] & (k.shape[-1] - 1) == 0:
        append_kv_triton(k.contiguous(), v.contiguous(), window, order, at)
    else:
        append_kv_ref(k, v, window, order, at)
