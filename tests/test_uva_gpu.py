"""The UVA kernels on the GPU against their references (pytest -m gpu): the block copy with negative indices
and hybrid attention, and host memory pinned each way (cudaHostRegister'd by threads, packed stores in one pinned
block, on transparent huge pages) read exactly over UVA and copied."""

import pytest
import torch

from kvoffload.kv.interface import KVSpec
from tests.gpu_helpers import CUDA

pytestmark = pytest.mark.gpu


def test_uva_copy_blocks_and_negative_indices_match_their_references():
    from kvoffload.kernels.decode_attention import hybrid_attention, hybrid_attention_ref
    from kvoffload.kernels.uva_gather import copy_blocks_ref, uva_copy_blocks

    g = torch.Generator().manual_seed(0)
    host = torch.randn(50, 8, 2, 64, generator=g).to(torch.bfloat16).pin_memory()
    src = torch.randint(-1, 50, (30,), generator=g, dtype=torch.int32)
    dst = torch.randperm(40, generator=g)[:30].int()
    want = torch.zeros(40, 8, 2, 64, dtype=torch.bfloat16)
    copy_blocks_ref(host, src, want, dst)
    got = torch.zeros(40, 8, 2, 64, dtype=torch.bfloat16, device=CUDA)
    uva_copy_blocks(host, src.to(CUDA), got, dst.to(CUDA))
    assert torch.equal(got.cpu(), want)
    b, hkv, hq, d, t, kk = 2, 2, 8, 64, 100, 40
    q = torch.randn(b, hq, d, generator=g).to(torch.bfloat16)
    kv1 = [torch.randn(b, t, hkv, d, generator=g).to(torch.bfloat16) for _ in range(2)]
    pk, pv = (torch.randn(b, t, hkv, d, generator=g).to(torch.bfloat16) for _ in range(2))
    idx = torch.randint(-1, t, (b, hkv, kk), generator=g)
    lens = torch.tensor([60, 100])
    k2 = pk.new_empty(b, kk, 0, d)
    args = lambda dev: (  # noqa: E731
        q.to(dev),
        (kv1[0].to(dev), kv1[1].to(dev), lens.to(dev)),
        (k2.to(dev), k2.to(dev), torch.full((b,), kk, device=dev)),
        (pk.to(dev), pv.to(dev), idx.to(dev)),
    )
    ref = hybrid_attention_ref(*args(torch.device("cpu"))).float()
    out = hybrid_attention(*args(CUDA)).float().cpu()
    assert (out - ref).norm() / ref.norm() < 1e-2


def assert_uva_reads(host: torch.Tensor) -> None:
    """The UVA gather reads 300 rows of the pinned host tensor [rows, 8, 2, 64] (bf16) exactly, and a copy to the
    device returns it whole."""
    from kvoffload.kernels.uva_gather import copy_blocks_ref, uva_copy_blocks

    assert host.is_pinned()
    src = torch.randint(0, host.shape[0], (300,), dtype=torch.int32)
    dst = torch.randperm(400)[:300].int()
    want = torch.zeros(400, 8, 2, 64, dtype=torch.bfloat16)
    copy_blocks_ref(host, src, want, dst)
    got = torch.zeros(400, 8, 2, 64, dtype=torch.bfloat16, device=CUDA)
    uva_copy_blocks(host, src.to(CUDA), got, dst.to(CUDA))
    assert torch.equal(got.cpu(), want)
    assert torch.equal(host.to(CUDA, non_blocking=True).cpu(), host)


def test_memory_pinned_by_register_is_read_over_uva_and_copied():
    """hardware.pin_threads=N: host stores made by malloc, N threads' first touch and cudaHostRegister are mapped
    for the device (the UVA gather reads them) and copied as cudaHostAlloc's are."""
    from kvoffload.offload.host import empty_host_cache, host_buffer, pin_by_register

    empty_host_cache()  # no cached cudaHostAlloc block to hand out: this one is registered
    pin_by_register(4)
    try:
        host = host_buffer((123457, 8, 2, 64), torch.bfloat16, pinned=True)
    finally:
        pin_by_register(0)
    host.copy_(torch.randn(host.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16))
    assert_uva_reads(host)


def test_host_stores_packed_in_one_pinned_block_are_read_over_uva():
    """Stores whose size is no power of two share pinned blocks (host.store_packs): each is a view at an offset
    into its block, pinned, and gathered over UVA and copied exactly."""
    from kvoffload.offload.host import host_stores, store_packs

    spec = KVSpec(5, 1, 3003, 32, 8, 64, torch.bfloat16, CUDA, prompt_len=3000)  # stores of 3000 rows: packed
    stores = host_stores(spec, 1, 3000)
    assert store_packs(stores[1].nbytes, 4)[0] > 1
    g = torch.Generator().manual_seed(2)
    for s in stores[1:]:
        s.copy_(torch.randn(s.shape, generator=g).to(torch.bfloat16))
    assert stores[2].data_ptr() != stores[2].untyped_storage().data_ptr()  # a view at an offset into its block
    assert_uva_reads(stores[2].view(-1, 8, 2, 64))  # [rows, heads, 2, D] over the store's memory


HUGE_PAGE_CHECK = """
import torch
from kvoffload.kernels.uva_gather import copy_blocks_ref, uva_copy_blocks
from kvoffload.offload.host import anon_huge_gib, host_buffer, pin_by_register
pin_by_register(4)
before = anon_huge_gib()
host = host_buffer((1 << 17, 8, 2, 64), torch.bfloat16, pinned=True)  # 256 MiB, first touched by 4 threads
huge = anon_huge_gib() - before
host.copy_(torch.randn(host.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16))
src = torch.randint(0, host.shape[0], (300,), dtype=torch.int32)
dst = torch.randperm(400)[:300].int()
want = torch.zeros(400, 8, 2, 64, dtype=torch.bfloat16)
copy_blocks_ref(host, src, want, dst)
got = torch.zeros(400, 8, 2, 64, dtype=torch.bfloat16, device="cuda")
uva_copy_blocks(host, src.cuda(), got, dst.cuda())
print(host.is_pinned(), torch.equal(got.cpu(), want), huge)
"""


def test_memory_pinned_by_register_on_huge_pages_is_read_over_uva():
    """hardware.pin_huge_pages: in a process started with glibc's huge-page tunable, memory pinned by threads and
    cudaHostRegister lies on transparent huge pages (the system's THP mode allowing madvise) and is read exactly
    over UVA."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from kvoffload.offload.host import thp_env

    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("no transparent huge pages on this host")
    env = thp_env(dict(os.environ))
    out = subprocess.run([sys.executable, "-c", HUGE_PAGE_CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    pinned, exact, huge = out.stdout.split()
    assert pinned == "True" and exact == "True" and float(huge) >= 0.2, out.stdout
