"""The KVOffloadSystem contract, on FullAttn: what goes in at prefill and decode is what attention sees, the
memory it reports is its real buffers, the budget is enforced, and every step reports every phase."""

import pytest
import torch

from baselines.fullattn import FullAttn, dense_decode_attention
from kvoffload.errors import ConfigError
from kvoffload.kv.interface import KVSpec
from kvoffload.kv.timer import PHASES, PhaseTimer

B, H, HKV, D, L = 2, 8, 2, 16, 3


def spec(max_len=40, budget=None):
    return KVSpec(L, B, max_len, H, HKV, D, torch.float32, torch.device("cpu"), budget)


def test_decode_attends_over_prefill_and_appended_tokens():
    g = torch.Generator().manual_seed(0)
    kv = FullAttn()
    kv.allocate(spec())
    k0, v0 = torch.randn(L, B, HKV, 10, D, generator=g), torch.randn(L, B, HKV, 10, D, generator=g)
    for layer in range(L):
        kv.prefill(layer, k0[layer], v0[layer])
    kv.end_prefill(10)
    keys, values = k0, v0
    for _ in range(3):
        kv.begin_step()
        k1, v1 = torch.randn(L, B, HKV, D, generator=g), torch.randn(L, B, HKV, D, generator=g)
        keys, values = torch.cat([keys, k1[..., None, :]], 3), torch.cat([values, v1[..., None, :]], 3)
        for layer in range(L):
            q = torch.randn(B, H, D, generator=g)
            out = kv.decode(layer, q, k1[layer], v1[layer])
            # independent reference: explicit softmax over the grouped heads
            kr = keys[layer].repeat_interleave(H // HKV, dim=1)
            vr = values[layer].repeat_interleave(H // HKV, dim=1)
            w = torch.softmax(torch.einsum("bhd,bhtd->bht", q, kr) / D**0.5, -1)
            torch.testing.assert_close(out, torch.einsum("bht,bhtd->bhd", w, vr), atol=1e-5, rtol=1e-5)
        stats = kv.end_step()
        assert set(PHASES) <= set(stats.phase_ms) and stats.phase_ms["total"] >= stats.phase_ms["attention"] > 0
    assert kv.length == 13


def test_memory_held_is_the_estimate_and_the_real_buffers():
    kv = FullAttn()
    est = kv.estimate_memory(spec())
    kv.allocate(spec())
    # the token axis is padded to whole pages (48 = 3 pages of 16) so that flashinfer can read it as pages
    assert kv.memory_held().device_bytes == est.device_bytes == 2 * L * B * HKV * 48 * D * 4
    assert kv.memory_held().device_bytes == kv.k.nbytes + kv.v.nbytes


def test_budget_too_small_is_refused_before_allocating():
    kv = FullAttn()
    need = kv.estimate_memory(spec()).device_bytes
    with pytest.raises(ConfigError, match="budget"):
        kv.allocate(spec(budget=need - 1))
    assert not hasattr(kv, "k")
    kv.allocate(spec(budget=need))


def test_dense_reference_matches_explicit_softmax():
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(B, H, D, generator=g),
        torch.randn(B, HKV, 7, D, generator=g),
        torch.randn(B, HKV, 7, D, generator=g),
    )
    kr, vr = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
    w = torch.softmax(torch.einsum("bhd,bhtd->bht", q, kr) / D**0.5, -1)
    torch.testing.assert_close(dense_decode_attention(q, k, v), torch.einsum("bht,bhtd->bhd", w, vr))


def test_timer_rejects_unknown_phase_and_derives_other():
    t = PhaseTimer(torch.device("cpu"))
    t.begin_step()
    with pytest.raises(ValueError, match="unknown phase"):
        with t.phase("lunch"):
            pass
    with t.phase("retrieval"):
        sum(range(10000))
    out = t.end_step()
    assert out["retrieval"] > 0
    assert abs(out["total"] - sum(out[p] for p in PHASES)) < 1e-6


def test_bad_backend_is_a_config_error():
    with pytest.raises(ConfigError, match="valid: auto, sdpa, flashinfer, triton"):
        FullAttn(attention_backend="cuda-magic")


def test_static_shape_path_matches_eager():
    """The graph-capturable form (whole buffer, unwritten tail masked, position from a tensor) equals eager."""
    g = torch.Generator().manual_seed(2)
    systems = [FullAttn(), FullAttn()]
    for s in systems:
        s.allocate(spec(max_len=20))
    systems[1].use_static_shapes()
    k0, v0 = torch.randn(L, B, HKV, 9, D, generator=g), torch.randn(L, B, HKV, 9, D, generator=g)
    for s in systems:
        for layer in range(L):
            s.prefill(layer, k0[layer], v0[layer])
        s.end_prefill(9)
    for _ in range(4):
        q, k1, v1 = (
            torch.randn(B, H, D, generator=g),
            torch.randn(B, HKV, D, generator=g),
            torch.randn(B, HKV, D, generator=g),
        )
        outs = []
        for s in systems:
            s.begin_step()
            outs.append(s.decode(0, q, k1, v1))
            s.end_step()
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_paused_timer_records_nothing():
    t = PhaseTimer(torch.device("cpu"))
    t.begin_step()
    with t.paused():
        with t.phase("retrieval"):
            sum(range(10000))
    assert t.enabled and t.end_step()["retrieval"] == 0.0
