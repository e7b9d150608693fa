"""One call of the synthetic persistent + AR(1) query process (experiments/workloads/query_process.py) in one launch.

Per row (sequence, query head) of D elements, all fp32 but q and out:
  q     [R, D]   the model's query (its norm is kept)
  p, a  [R, D]   the query chain: fixed direction p, AR(1) part a (a updated in place when advancing)
  na    [R, D]   the standard normal draw that advances a (read only when advancing)
  pe, ae, ne     the speculative error's chain, the same way (only with an error chain)
  c, rho, g [H]  per query head: persistent share, AR(1) coefficient, speculative cosine
Row r is query head r % H. With `speculative` the output is the one-layer-ahead query, turned from the query
direction u towards the error direction by cos g; otherwise u. Out = that direction x |q|.

The torch code of experiments/workloads/query_process.py is the specification; there it takes some thirty small kernels
per call, a workload's cost inside every system's timed step. The random draws stay torch's (the same generator, the
same order), so both give the same values.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: the torch process is used
    triton = None


if triton is not None:

    @triton.jit
    def _advance(p, a, e, rho):
        """a's next value: rho a + sqrt(1 - rho^2) e', e' = e made orthogonal to p and unit; then unit."""
        e = e - tl.sum(e * p, axis=0) * p
        e = e / tl.maximum(tl.sqrt(tl.sum(e * e, axis=0)), 1e-12)
        new = rho * a + tl.sqrt(tl.maximum(1.0 - rho * rho, 0.0)) * e
        return new / tl.maximum(tl.sqrt(tl.sum(new * new, axis=0)), 1e-12)

    @triton.jit
    def _query_chain_kernel(
        Q, Out, P, A, NA, PE, AE, NE, C, Rho, G,
        H: tl.constexpr,
        D: tl.constexpr,
        ADVANCE: tl.constexpr,
        HAS_ERR: tl.constexpr,
        SPECULATIVE: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0)
        h = r % H
        d = tl.arange(0, D)
        off = r.to(tl.int64) * D + d
        q = tl.load(Q + off).to(tl.float32)
        c = tl.load(C + h)
        rho = tl.load(Rho + h)
        sc, sa = tl.sqrt(c), tl.sqrt(1.0 - c)
        p = tl.load(P + off)
        a = tl.load(A + off)
        if ADVANCE:
            a = _advance(p, a, tl.load(NA + off), rho)
            tl.store(A + off, a)
        u = sc * p + sa * a
        if HAS_ERR:
            pe = tl.load(PE + off)
            ae = tl.load(AE + off)
            if ADVANCE:
                ae = _advance(pe, ae, tl.load(NE + off), rho)
                tl.store(AE + off, ae)
            if SPECULATIVE:
                g = tl.load(G + h)
                w = sc * pe + sa * ae
                w = w - tl.sum(w * u, axis=0) * u
                w = w / tl.maximum(tl.sqrt(tl.sum(w * w, axis=0)), 1e-12)
                u = g * u + tl.sqrt(tl.maximum(1.0 - g * g, 0.0)) * w
        norm = tl.sqrt(tl.sum(q * q, axis=0))
        tl.store(Out + off, (u * norm).to(Out.dtype.element_ty))


def query_chain(
    q: torch.Tensor,
    chain: tuple[torch.Tensor, torch.Tensor],
    err: tuple[torch.Tensor, torch.Tensor] | None,
    c: torch.Tensor,
    rho: torch.Tensor,
    g: torch.Tensor | None,
    advance: bool,
    speculative: bool,
) -> torch.Tensor:
    """q [B, H, D] -> the process's query [B, H, D] in q's dtype; advances chain's (and err's) AR(1) part in place
    when `advance`. c, rho, g: the layer's [H] fp32 values. CUDA only (Triton)."""
    b, h, d = q.shape
    p, a = chain
    pe, ae = err if err is not None else (p, a)  # unread without an error chain
    na = torch.randn_like(a) if advance else a  # drawn in the torch process's order: the query's, then the error's
    ne = torch.randn_like(ae) if advance and err is not None else a
    q = q.contiguous()
    out = torch.empty_like(q)  # contiguous as q now is: the kernel writes rows of D
    _query_chain_kernel[(b * h,)](
        q, out, p, a, na, pe, ae, ne, c, rho, c if g is None else g,
        H=h, D=d, ADVANCE=advance, HAS_ERR=err is not None, SPECULATIVE=speculative and err is not None,
    )  # fmt: skip
    return out
