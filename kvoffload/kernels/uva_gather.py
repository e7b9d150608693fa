"""Zero-copy gather of KV rows from pinned host memory into device cache slots (docs/systems.md, "Transfer": the `uva`
path).

  host   [B, Hkv, T, 2, D]  pinned CPU tensor (K then V of one token of one KV head: one contiguous row)
  heads  [h] long           KV heads that own the slots (device)
  idx    [B, h, k] long     token indices to fetch (device)
  miss   [B, h] bool        which slots to refill (device)
  slots  [B, h, k, 2, D]    device; slots[b, j] := host[b, heads[j], idx[b, j]] wherever miss[b, j]
  record optional (slot_idx [B, h, k] long, misses [B, h] int32): the bookkeeping of what moved, where
         miss[b, j]: slot_idx[b, j] := idx[b, j] and misses[b, j] += 1 (CLO's stores). The kernel does it
         beside the rows, so nothing is launched after the gather (two torch kernels were, on the chain that
         the next layer's attention waits for)

The kernel reads the host rows through their pointer (UVA: a pinned allocation is mapped into the device's
address space), so there is no CPU gather, no staging buffer and no host sync; the grid depends only on
shapes, so it can be captured in a CUDA graph. Hit heads are skipped before touching the link.
`uva_gather_ref` is the specification; `TransferEngine.fill` on the CPU runs `gather_into_cpu`, its rows for
contiguous host stores (only the missed heads' rows are read).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: the reference is used
    triton = None


def gather_rows_ref(host: torch.Tensor, heads: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """host [B, Hkv, T, 2, D]; heads [h]; idx [B, h, k] token indices -> rows [B, h, k, 2, D]."""
    b = torch.arange(idx.shape[0], device=idx.device)[:, None, None]
    return host[b, heads.to(idx.device)[None, :, None], idx]


def uva_gather_ref(
    host: torch.Tensor,
    heads: torch.Tensor,
    idx: torch.Tensor,
    miss: torch.Tensor,
    slots: torch.Tensor,
    record: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    rows = gather_rows_ref(host, heads.to(host.device), idx.to(host.device)).to(slots.device)
    slots.copy_(torch.where(miss[..., None, None, None], rows, slots))
    record_moves_ref(idx, miss, record)


def gather_into_cpu(
    host: torch.Tensor, heads: torch.Tensor, idx: torch.Tensor, miss: torch.Tensor, slots: torch.Tensor
) -> None:
    """uva_gather_ref's rows (no record) for CPU tensors, host contiguous: only the missed heads' rows are read, by one
    index_select over the host's flat rows, where the reference gathers every head's and keeps the missed ones."""
    assert host.is_contiguous() and not (host.is_cuda or slots.is_cuda or idx.is_cuda or miss.is_cuda)
    pairs = miss.nonzero()
    if not len(pairs):
        return
    b, j = pairs[:, 0], pairs[:, 1]
    hkv, t = host.shape[1], host.shape[2]
    tok = idx[b, j]
    tok = torch.where(tok < 0, tok + t, tok)  # as the reference's indexing reads a negative index
    flat = ((b * hkv + heads.to(b.device)[j]) * t)[:, None] + tok
    rows = torch.index_select(host.view(-1, *host.shape[3:]), 0, flat.view(-1))
    slots[b, j] = rows.view(len(pairs), *slots.shape[2:])


def record_moves_ref(idx: torch.Tensor, miss: torch.Tensor, record: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    if record is not None:
        slot_idx, misses = record
        torch.where(miss[..., None], idx, slot_idx, out=slot_idx)
        misses += miss


if triton is not None:

    @triton.jit
    def _uva_gather_kernel(
        Host,
        Heads,
        Idx,
        Miss,
        Slots,
        SlotIdx,
        Misses,
        K,
        BH,
        TILES_PER_HEAD,
        stride_hb,
        stride_hh,
        stride_ht,
        stride_ib,
        stride_ih,
        stride_sb,
        stride_sh,
        stride_sk,
        stride_xb,
        stride_xh,
        stride_mb,
        H: tl.constexpr,
        ROW: tl.constexpr,
        ROW_PAD: tl.constexpr,
        BLOCK: tl.constexpr,
        RECORD: tl.constexpr,
    ):
        c = tl.arange(0, ROW_PAD)
        r = tl.arange(0, BLOCK)
        # grid-stride over every (sequence, head) pair's tiles (BLOCK rows each), head by head and within a head
        # sequence by sequence: a capped number of programs keeps the link busy without holding every SM while it
        # waits on the link, and the pairs that miss (often a few heads of every sequence) are consecutive work that
        # spreads over all the programs, whether a pair is one tile (a short context) or thousands
        B = BH // H
        total = BH * TILES_PER_HEAD
        w = tl.program_id(0)
        while w < total:
            pair = w // TILES_PER_HEAD
            j = pair // B
            b = pair % B
            if tl.load(Miss + b * H + j) == 0:  # a hit: nothing crosses the link; on to this program's next pair
                w += tl.cdiv((pair + 1) * TILES_PER_HEAD - w, tl.num_programs(0)) * tl.num_programs(0)
            else:
                tile = w % TILES_PER_HEAD
                w += tl.num_programs(0)
                head = tl.load(Heads + j)
                if RECORD:
                    if tile == 0:  # the pair's first tile counts the move: once, no atomics
                        at = Misses + b * stride_mb + j
                        tl.store(at, tl.load(at) + 1)
                i = tile * BLOCK + r
                rmask = i < K
                tok = tl.load(Idx + b.to(tl.int64) * stride_ib + j * stride_ih + i, mask=rmask, other=0)
                mask = rmask[:, None] & (c < ROW)[None, :]
                # int64 offsets: a host store is easily larger than 2^31 elements
                src = Host + (b.to(tl.int64) * stride_hb + head * stride_hh + tok * stride_ht)[:, None] + c[None, :]
                rows = tl.load(src, mask=mask)  # BLOCK rows in flight per program: the link needs many reads
                dst = (
                    Slots
                    + (b.to(tl.int64) * stride_sb + j * stride_sh + i.to(tl.int64) * stride_sk)[:, None]
                    + c[None, :]
                )
                tl.store(dst, rows, mask=mask)
                if RECORD:
                    tl.store(SlotIdx + b.to(tl.int64) * stride_xb + j * stride_xh + i, tok, mask=rmask)


def uva_gather(
    host: torch.Tensor,
    heads: torch.Tensor,
    idx: torch.Tensor,
    miss: torch.Tensor,
    slots: torch.Tensor,
    block: int | None = None,
    programs: int | None = None,
    num_warps: int = 4,
    record: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """In place on `slots`. `host` must be pinned when the others live on a GPU (Triton's launcher refuses
    an unmapped host pointer); in the Triton interpreter every tensor is a CPU tensor. `block` rows per
    program: by default ~16 KB, which keeps the link full (so does any block in the 4..64 rows the default is
    clamped to). `programs` caps the grid (None: one program per tile of every (sequence, head) pair); the
    programs stride over all pairs' tiles, head by head, skipping a pair that hit after one load, so many short
    heads (a large batch at a short context) spread over them as one long head's tiles do. A few dozen programs
    keep the link full and leave the SMs to work that overlaps the transfer (CLO's `uva_programs`). record: see
    the module's docstring."""
    b, h, k = idx.shape
    d = host.shape[-1]
    assert host.shape[3] == 2 and slots.shape == (b, h, k, 2, d) and heads.shape == (h,) and miss.shape == (b, h)
    assert host.dtype == slots.dtype, "the gather copies bits: host and slots share one dtype"
    # a row (K and V) must be contiguous in both, so it is read as one run of wide loads
    assert host.stride(4) == slots.stride(4) == 1 and host.stride(3) == slots.stride(3) == d
    if not (b and h and k):
        return
    idx = idx if idx.stride(2) == 1 else idx.contiguous()
    slot_idx, misses = record if record is not None else (idx, miss)  # unread without RECORD
    assert record is None or (
        slot_idx.shape == idx.shape
        and slot_idx.stride(2) == 1
        and slot_idx.dtype == idx.dtype
        and misses.shape == miss.shape
        and misses.stride(1) == 1
    ), "record: [B, h, k], [B, h]"
    miss = miss.contiguous().view(torch.uint8)
    block = block or min(64, max(4, triton.next_power_of_2(16384 // (2 * d * host.element_size()))))
    tiles_per_head = triton.cdiv(k, block)
    work = b * h * tiles_per_head
    grid = (min(work, programs or work),)
    _uva_gather_kernel[grid](
        host,
        heads.contiguous(),
        idx,
        miss,
        slots,
        slot_idx,
        misses,
        k,
        b * h,
        tiles_per_head,
        host.stride(0),
        host.stride(1),
        host.stride(2),
        idx.stride(0),
        idx.stride(1),
        slots.stride(0),
        slots.stride(1),
        slots.stride(2),
        slot_idx.stride(0),
        slot_idx.stride(1),
        misses.stride(0),
        H=h,
        ROW=2 * d,
        ROW_PAD=triton.next_power_of_2(2 * d),
        BLOCK=block,
        RECORD=record is not None,
        num_warps=num_warps,
    )


def copy_blocks_ref(host: torch.Tensor, src: torch.Tensor, dst_buf: torch.Tensor, dst: torch.Tensor) -> None:
    """Whole blocks from host memory into device slots (RetroInfer's misses into their cache slots):
    host [NB, ...] and dst_buf [NS, ...] blocks of one shape; src, dst [M] int: block src[i] of the host goes to
    slot dst[i], for every i with src[i] >= 0 (the others are hits, left alone)."""
    take = (src >= 0).nonzero().view(-1)
    if take.numel():
        dst_buf[dst[take].long().to(dst_buf.device)] = host[src[take].long().to(host.device)].to(dst_buf.device)


if triton is not None:

    @triton.jit
    def _copy_blocks_kernel(Host, Src, Buf, Dst, M, SIZE: tl.constexpr, CHUNK: tl.constexpr):
        # grid-stride over the M entries; a hit (src < 0) costs one load
        for i in range(tl.program_id(0), M, tl.num_programs(0)):
            s = tl.load(Src + i)
            if s >= 0:
                t = tl.load(Dst + i).to(tl.int64)
                for c0 in range(0, SIZE, CHUNK):
                    c = c0 + tl.arange(0, CHUNK)
                    mask = c < SIZE
                    rows = tl.load(Host + s.to(tl.int64) * SIZE + c, mask=mask)
                    tl.store(Buf + t * SIZE + c, rows, mask=mask)


def uva_copy_blocks(
    host: torch.Tensor,
    src: torch.Tensor,
    dst_buf: torch.Tensor,
    dst: torch.Tensor,
    programs: int = 1024,
    num_warps: int = 4,
) -> None:
    """copy_blocks_ref on the GPU, reading the pinned host blocks through their device mapping (UVA): no CPU
    gather, no staging, no host sync, a grid that depends only on M (capturable in a CUDA graph). host and
    dst_buf contiguous; src, dst [M] int32 on the device."""
    assert host.is_contiguous() and dst_buf.is_contiguous() and host.dtype == dst_buf.dtype
    assert host.shape[1:] == dst_buf.shape[1:] and src.shape == dst.shape and src.dim() == 1
    size = host[0].numel()
    m = src.shape[0]
    if not m:
        return
    chunk = min(4096, triton.next_power_of_2(size))
    _copy_blocks_kernel[(min(m, programs),)](host, src, dst_buf, dst, m, SIZE=size, CHUNK=chunk, num_warps=num_warps)
