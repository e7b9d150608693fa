"""hardware.link_gb_s on a CPU: the pacing schedule and the link clock's model (kvoffload/kernels/link_pacer.py),
and the cap's bad input refused as one `error:` line (the GPU's achieved rates: tests/test_link_cap_gpu.py)."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvoffload.errors import ConfigError
from kvoffload.kernels.link_pacer import chunk_rows, claim_ref, quantum_bytes, simulate_ref, slot_ns
from kvoffload.kv.interface import KVSpec
from kvoffload.offload.link import LinkPacer, link_pacer
from tests.run_helpers import run, single_error

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9


def test_a_slot_is_never_shorter_than_its_bytes_at_the_cap():
    assert slot_ns(21_210, 21.21 * GB) == 1000
    assert slot_ns(21_211, 21.21 * GB) == 1001  # rounded up: a paced transfer is never faster than the cap
    assert slot_ns(0, GB) == 0
    with pytest.raises(ValueError):
        slot_ns(1, 0.0)


@pytest.mark.parametrize("gb_s", [8.0, 16.0, 21.21, 32.0])
def test_a_chunk_is_one_quantum_at_the_cap(gb_s):
    q = quantum_bytes(gb_s * GB, quantum_s=200e-6, align=1 << 16)
    assert q % (1 << 16) == 0
    # within one alignment step of 200 us of bytes at the cap
    assert gb_s * GB * 200e-6 <= q < gb_s * GB * 200e-6 + (1 << 16)
    assert quantum_bytes(1.0, align=4096) == 4096  # never below one alignment


@pytest.mark.parametrize("rows,row_bytes,chunk", [(1, 512, 4096), (100, 512, 4096), (7, 1000, 999), (0, 8, 64)])
def test_chunks_cover_every_row_once_in_order(rows, row_bytes, chunk):
    spans = chunk_rows(rows, row_bytes, chunk)
    covered = [r for a, b in spans for r in range(a, b)]
    assert covered == list(range(rows))
    assert all(b > a for a, b in spans)
    assert all((b - a) * row_bytes <= max(chunk, row_bytes) for a, b in spans)


def test_a_claim_starts_at_the_clock_or_now_whichever_is_later():
    assert claim_ref(clock=0, now=500, dt=100) == (500, 600)  # an idle link: the slot starts now
    assert claim_ref(clock=900, now=500, dt=100) == (900, 1000)  # a busy one: after the last slot


@pytest.mark.parametrize("cap_gb_s", [8.0, 16.0, 21.21, 32.0])
def test_one_paced_copy_moves_at_the_cap_on_a_faster_link(cap_gb_s):
    nbytes, chunk = 256 << 20, quantum_bytes(cap_gb_s * GB)
    sizes = [min(chunk, nbytes - a) for a in range(0, nbytes, chunk)]
    ((start, end),) = simulate_ref([(1000, sizes)], cap_gb_s * GB, link_bytes_per_s=54 * GB)
    achieved = nbytes / (end - start)  # bytes per ns = GB/s
    assert abs(achieved - cap_gb_s) / cap_gb_s < 0.01


def test_a_cap_above_the_link_leaves_the_link_as_it_is():
    sizes = [1 << 20] * 64
    ((start, end),) = simulate_ref([(0, sizes)], 100 * GB, link_bytes_per_s=50 * GB)
    assert abs(64 * (1 << 20) / (end - start) - 50) < 0.5


def test_concurrent_paced_transfers_share_the_cap():
    """Two streams moving at once take consecutive slots of one clock: their sum keeps to the cap, where two
    independently paced streams would move twice as much."""
    cap, chunk = 21.21 * GB, quantum_bytes(21.21 * GB)
    a, b = [chunk] * 40, [chunk] * 40
    (sa, ea), (sb, eb) = simulate_ref([(0, a), (0, b)], cap, link_bytes_per_s=54 * GB)
    total = (sum(a) + sum(b)) / (max(ea, eb) - min(sa, sb))
    assert abs(total - 21.21) / 21.21 < 0.02
    assert min(ea, eb) > 0.9 * (sum(a) / 21.21)  # neither finished as if it had the link alone at full speed


def test_no_cap_no_pacer_and_a_cpu_pacer_is_refused():
    spec = KVSpec(2, 1, 64, 4, 2, 8, torch.float32, torch.device("cpu"))
    assert link_pacer(spec) is None  # unset: every path runs as before, nothing paced
    with pytest.raises(ConfigError, match="a cpu run has none"):
        link_pacer(replace(spec, link_cap_gb_s=21.21))
    with pytest.raises(ConfigError, match="caps a GPU's host link"):
        LinkPacer(torch.device("cpu"), 8.0)


def test_clo_refuses_a_pinned_link_above_the_cap():
    from clo.config import CLOConfig
    from clo.plan import make_plan

    spec = KVSpec(2, 1, 64, 4, 2, 8, torch.float32, torch.device("cpu"), link_cap_gb_s=16.0, link_gb_s=16.0)
    with pytest.raises(ConfigError, match=r"system.link_gb_s=32 plans with more than the link's cap"):
        make_plan(CLOConfig.from_settings({"link_gb_s": 32.0, "dense_layers": 1}), spec)
    plan = make_plan(CLOConfig.from_settings({"dense_layers": 1}), spec)
    assert plan.link_bytes_per_s == 16.0 * GB  # unpinned: Eq. 12 plans with the cap


def test_the_link_cap_reaches_the_check_of_numbers():
    from experiments.runner.run_settings import check_link_cap, check_numbers
    from tests.test_config import composed

    assert check_numbers(composed("hardware.link_gb_s=21.21")).link_cap_gb_s == 21.21
    assert check_numbers(composed()).link_cap_gb_s is None
    with pytest.raises(ConfigError, match=r"above this link's bulk pinned copy, measured at 20\.00 GB/s"):
        check_link_cap(21.21, torch.device("cuda"), 20.0)
    check_link_cap(21.21, torch.device("cuda"), 54.0)  # below the measured link: accepted


def refused(*overrides: str, tmp: Path) -> str:
    """experiments.run with the overrides: exit status 2, one `error:` line on stderr; returns it."""
    p = run("wandb.enabled=false", "model.weights=synthetic", "seqlen=64", *overrides, tmp=tmp, check=False)
    return single_error(p)


@pytest.mark.parametrize("cap", ["0", "-21.21"])
def test_a_cap_at_or_below_zero_is_refused(tmp_path, cap):
    line = refused(f"hardware.link_gb_s={cap}", tmp=tmp_path)
    assert f"hardware.link_gb_s={cap} must be above 0" in line


def test_a_cap_on_a_cpu_run_is_refused(tmp_path):
    line = refused("hardware.link_gb_s=21.21", "device=cpu", "system=clo", tmp=tmp_path)
    assert "hardware.link_gb_s=21.21 caps a GPU's host link; a cpu run has none" in line
