"""Hash scores on the CPU (kvoffload/kernels/hash_score.py's arithmetic): the Hamming distances in one compiled pass
over the key codes, 64-bit words XORed and counted with the popcount instruction. Serial: numba's thread pool
beside torch's would have four threads contend for a 2-core machine's cores.

The reference (`hash_scores_ref`) looks every XORed byte up in a 256-entry table through an int64 index tensor
of B x h x G x T x rbit/8 entries, the larger part of a sparse system's CPU decode step. Here only the distance
sums (and a copy of the scored heads' norms) are compiled; the scores are made from them by the reference's own
torch expression, so they are the reference's bit for bit (the distances are exact integers either way).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import types
from numba.extending import intrinsic


@intrinsic
def _popcount(typingctx, x):
    """LLVM's ctpop on a uint64: the popcnt instruction where the host has it."""

    def codegen(context, builder, signature, args):
        return builder.ctpop(args[0])

    return types.uint64(types.uint64), codegen


@numba.njit(nogil=True, cache=True)
def _hamming_sums(codes, norms, qcodes, heads, out, out_norms):
    """codes [B, Hk, T, W] uint64; norms [B, Hk, T] fp32; qcodes [B, h, G, W] uint64; heads [h] int64 -> out
    [B, h, T] int64 := sum over g of popcount(qcodes[b, j, g] ^ codes[b, heads[j], t]), and out_norms [B, h, T] :=
    norms[b, heads[j], t] (a copy: torch's indexing of a few thousand rows can cost a scheduler slice on a loaded
    machine, where one of its threads waits for a core)."""
    nb, nh, ng, nw = qcodes.shape
    nt = codes.shape[2]
    for b in range(nb):
        for j in range(nh):
            keys, q, o = codes[b, heads[j]], qcodes[b, j], out[b, j]
            out_norms[b, j] = norms[b, heads[j]]
            for t in range(nt):
                s = 0
                for g in range(ng):
                    for w in range(nw):
                        s += _popcount(keys[t, w] ^ q[g, w])
                o[t] = s


def _words(x: torch.Tensor) -> np.ndarray:
    """uint8 codes [..., rbit / 8] -> a uint64 numpy view [..., rbit / 64] over the same bytes (over a contiguous copy
    when x is not contiguous)."""
    return x.contiguous().view(torch.int64).numpy().view(np.uint64)


def runs(codes: torch.Tensor, rbit: int) -> bool:
    """Where this path applies: CPU tensors, whole 64-bit words."""
    return codes.device.type == "cpu" and rbit % 64 == 0


def hash_scores_cpu(
    codes: torch.Tensor, norms: torch.Tensor, qcodes: torch.Tensor, rbit: int, heads: torch.Tensor | None = None
) -> torch.Tensor:
    """hash_scores_ref's result (scores [B, h, T] fp32, every row scored) for CPU tensors with rbit % 64 == 0."""
    b, hk, t, nbytes = codes.shape
    assert runs(codes, rbit) and nbytes * 8 == rbit == qcodes.shape[3] * 8
    if heads is None:
        heads = torch.arange(hk)
    ham = torch.empty(b, heads.shape[0], t, dtype=torch.int64)
    norms_h = torch.empty(b, heads.shape[0], t, dtype=norms.dtype)
    if ham.numel():
        heads_np = heads.long().contiguous().numpy()
        _hamming_sums(_words(codes), norms.numpy(), _words(qcodes), heads_np, ham.numpy(), norms_h.numpy())
    # the reference's expression on the same integers and norms: the same fp32 scores
    return (qcodes.shape[2] - 2.0 * ham.float() / rbit) * norms_h
