"""hardware.link_gb_s on the GPU: every path paced by kvoffload/offload/link.py lands within 10 % of the cap, moves
the same bytes it moves unpaced, and keeps to the cap across streams and inside a CUDA graph; the run command
records the cap and refuses one above the measured link (run on the GPU machine: pytest -m gpu)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments.runner.timing import median_ms, pinned_h2d_gb_s
from kvoffload.kernels import link_pacer
from kvoffload.kernels.uva_gather import copy_blocks_ref, gather_rows_ref, uva_copy_blocks
from kvoffload.offload.link import LinkPacer, moving
from kvoffload.offload.transfer import TransferEngine

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 0.10
SHARES = (0.25, 0.5)  # caps as shares of this machine's measured bulk copy: no link rate is written in here


def bulk_gb_s() -> float:
    return pinned_h2d_gb_s(CUDA)


def gb_s(nbytes: int, fn) -> float:
    return nbytes / median_ms(fn, CUDA, repeats=5, warmup=1) / 1e6


def gather_case(tokens: int = 16384, heads: int = 8, d: int = 128):
    """A layer's top-k rows at Llama-3 shapes, scattered over four times as many."""
    g = torch.Generator().manual_seed(0)
    host = torch.randn(1, heads, 4 * tokens, 2, d, generator=g).to(torch.bfloat16).pin_memory()
    idx = torch.stack([torch.randperm(4 * tokens, generator=g)[:tokens].sort().values for _ in range(heads)])
    slots = torch.zeros(1, heads, tokens, 2, d, dtype=torch.bfloat16, device=CUDA)
    return host, torch.arange(heads, device=CUDA), idx[None].to(CUDA), slots


@pytest.mark.parametrize("share", SHARES)
def test_bulk_copy_and_uva_gather_land_within_ten_percent_of_the_cap(share):
    cap = share * bulk_gb_s()
    pacer = LinkPacer(CUDA, cap)
    src = torch.randint(0, 255, (256 << 20,), dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device=CUDA)
    got = gb_s(src.nbytes, lambda: pacer.copy_(dst, src))
    assert abs(got - cap) / cap <= TOLERANCE, (got, cap)
    assert torch.equal(dst.cpu(), src)
    host, heads, idx, slots = gather_case()
    miss = torch.ones(1, heads.numel(), dtype=torch.bool, device=CUDA)
    engine = TransferEngine("uva", 1, CUDA, 32, pacer)
    got = gb_s(slots.nbytes, lambda: engine.fill(host, heads, idx, miss, slots))
    assert abs(got - cap) / cap <= TOLERANCE, (got, cap)
    assert torch.equal(slots.cpu(), gather_rows_ref(host, heads.cpu(), idx.cpu()))


def test_a_gather_is_paced_by_the_heads_it_moves():
    """The slot's bytes are counted on the GPU from the miss mask: half the heads missing take half the time, all
    hitting take no slot at all."""
    cap = SHARES[0] * bulk_gb_s()
    pacer = LinkPacer(CUDA, cap)
    host, heads, idx, slots = gather_case()
    engine = TransferEngine("uva", 1, CUDA, 32, pacer)
    half = (torch.arange(heads.numel(), device=CUDA) % 2 == 0)[None]
    moved = slots.nbytes // 2
    got = gb_s(moved, lambda: engine.fill(host, heads, idx, half, slots))
    assert abs(got - cap) / cap <= TOLERANCE, (got, cap)
    none = torch.zeros_like(half)
    slot_ms = moved / (cap * 1e6)
    assert median_ms(lambda: engine.fill(host, heads, idx, none, slots), CUDA) < 0.1 * slot_ms


def test_cpu_gather_and_block_copies_keep_to_the_cap():
    cap = SHARES[0] * bulk_gb_s()
    pacer = LinkPacer(CUDA, cap)
    host, heads, idx, slots = gather_case()
    miss = torch.ones(1, heads.numel(), dtype=torch.bool, device=CUDA)
    engine = TransferEngine("cpu_gather", 8, CUDA, pacer=pacer)
    got = gb_s(slots.nbytes, lambda: engine.fill(host, heads, idx, miss, slots))
    assert got <= cap * (1 + TOLERANCE), (got, cap)  # the CPU gather may be slower than the cap, never faster
    assert torch.equal(slots.cpu(), gather_rows_ref(host, heads.cpu(), idx.cpu()))
    # RetroInfer-style's blocks: the missed ones (src >= 0) counted on the GPU
    blocks = host.view(-1, 8, 2, 128)
    src = torch.randperm(blocks.shape[0])[:4096].to(torch.int32)
    src[::2] = -1  # hits: nothing moves for them
    src, dst = src.to(CUDA), torch.arange(4096, dtype=torch.int32, device=CUDA)
    cache = torch.zeros(4096, 8, 2, 128, dtype=torch.bfloat16, device=CUDA)

    def copy():
        with moving(pacer, count=src, unit_bytes=blocks[0].nbytes):
            uva_copy_blocks(blocks, src, cache, dst)

    # 4 KB blocks may copy slower than the cap on their own: paced, the copy runs at the slower of the two
    own = gb_s(2048 * blocks[0].nbytes, lambda: uva_copy_blocks(blocks, src, cache, dst))
    got = gb_s(2048 * blocks[0].nbytes, copy)
    assert min(cap, own) * (1 - TOLERANCE) <= got <= cap * (1 + TOLERANCE), (got, cap, own)
    want = torch.zeros_like(cache)
    copy_blocks_ref(blocks, src.cpu(), want, dst.cpu())
    assert torch.equal(cache, want)


def test_two_streams_share_one_cap_and_a_graph_keeps_it():
    cap = SHARES[1] * bulk_gb_s()
    pacer = LinkPacer(CUDA, cap)
    srcs = [torch.ones(128 << 20, dtype=torch.uint8).pin_memory() for _ in range(2)]
    dsts = [torch.empty_like(s, device=CUDA) for s in srcs]
    streams = [torch.cuda.Stream() for _ in srcs]

    def both():
        for s, d, st in zip(srcs, dsts, streams):
            st.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(st):
                pacer.copy_(d, s)
        for st in streams:
            torch.cuda.current_stream().wait_stream(st)

    got = gb_s(2 * srcs[0].nbytes, both)
    assert abs(got - cap) / cap <= TOLERANCE, (got, cap)  # their sum, not each, at the cap
    graph = torch.cuda.CUDAGraph()
    pacer.copy_(dsts[0], srcs[0])
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        pacer.copy_(dsts[0], srcs[0])
    got = gb_s(srcs[0].nbytes, graph.replay)
    assert abs(got - cap) / cap <= TOLERANCE, (got, cap)


def test_no_cap_launches_no_pacing(monkeypatch):
    def refuse(*_, **__):
        raise AssertionError("a pacing kernel without a cap")

    monkeypatch.setattr(link_pacer, "claim", refuse)
    monkeypatch.setattr(link_pacer, "wait", refuse)
    host, heads, idx, slots = gather_case(1024)
    miss = torch.ones(1, heads.numel(), dtype=torch.bool, device=CUDA)
    for kind in ("uva", "cpu_gather"):
        TransferEngine(kind, 2, CUDA).fill(host, heads, idx, miss, slots)
    torch.cuda.synchronize()


def run(tmp: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.run",
            f"results_dir={tmp / 'results'}",
            f"hydra.run.dir={tmp / 'out'}",
            "wandb.enabled=false",
            "model.weights=synthetic",
            "workload.prompt=random",
            "workload.gen_tokens=8",
            "seqlen=4k",
            *overrides,
        ],
        cwd=ROOT,
        env={**os.environ, "WANDB_SILENT": "true", "HYDRA_FULL_ERROR": "0"},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize("system", ["clo", "retroinfer", "infinigen", "shadowkv"])
def test_a_capped_run_plans_and_records_the_cap(tmp_path, system):
    cap = round(SHARES[1] * bulk_gb_s(), 2)
    p = run(tmp_path, f"system={system}", f"hardware.link_gb_s={cap}")
    assert p.returncode == 0, p.stderr[-3000:]
    (rec,) = [json.loads(f.read_text()) for f in (tmp_path / "results").glob("*/record.json")]
    link = rec["link"]
    assert link["cap_gb_s"] == cap and "globaltimer" in link["mechanism"] and link["bulk_unpaced_gb_s"] > cap
    for path, got in link["achieved_gb_s"].items():
        assert abs(got - cap) / cap <= TOLERANCE, (path, got, cap)
    assert rec["system_state"]["link_gb_s"] == pytest.approx(cap)  # plans and floors read the cap
    m = rec["metrics"]
    link_ms = m["bytes_h2d_per_step"] / (cap * 1e9) * 1e3
    assert m["system_floor_parts_ms"]["link"] == pytest.approx(link_ms, rel=1e-3, abs=1e-4)


def test_a_cap_above_the_measured_link_is_refused(tmp_path):
    p = run(tmp_path, "system=clo", "hardware.link_gb_s=100000")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith("error: hardware.link_gb_s=100000 is above this link's bulk pinned copy")
