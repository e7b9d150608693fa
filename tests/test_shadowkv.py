"""ShadowKV-style (baselines/shadowkv.py, baselines/shadowkv_parts.py) on the CPU: keys of a known rank are rebuilt
exactly from the low-rank factors at their positions; with a budget covering every chunk its decode is dense
attention; chunks kept from the last step are neither rebuilt nor fetched; outliers are the chunks a landmark stands
for worst; the geometry is the original's; bad input is refused before any allocation."""

import math

import pytest
import torch

from baselines.fullattn import dense_decode_attention
from baselines.shadowkv import ShadowKV
from baselines.shadowkv_parts import (
    geometry,
    landmarks_and_outliers,
    low_rank,
    outlier_rule,
    rebuild,
    slot_assignment,
    unrotate,
)
from kvoffload.errors import ConfigError
from kvoffload.kernels.dense_ops import apply_rotary, cos_sin
from kvoffload.kv.interface import KVSpec
from kvoffload.kv.timer import PhaseTimer

B, HQ, HKV, D, LAYERS = 2, 6, 2, 16, 2
INV_FREQ = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))


def spec(t0: int, steps: int = 4, **kw) -> KVSpec:
    return KVSpec(LAYERS, B, t0 + steps, HQ, HKV, D, torch.float32, torch.device("cpu"), prompt_len=t0,
                  rope_inv_freq=tuple(INV_FREQ.tolist()), **kw)  # fmt: skip


def rotate(pre: torch.Tensor) -> torch.Tensor:
    cos, sin = cos_sin(torch.arange(pre.shape[2]), INV_FREQ, torch.float32)
    return apply_rotary(pre, cos, sin)


def known_rank_keys(t0: int, rank: int, g: torch.Generator) -> torch.Tensor:
    """Post-RoPE keys [B, HKV, t0, D] whose pre-RoPE keys, KV heads side by side, have rank `rank` exactly."""
    pre = torch.randn(B, t0, rank, generator=g) @ torch.randn(B, rank, HKV * D, generator=g)
    return rotate(pre.view(B, t0, HKV, D).transpose(1, 2).contiguous())


def built(t0: int, g: torch.Generator, k=None, **settings) -> tuple[ShadowKV, list]:
    system = ShadowKV(**settings)
    system.allocate(spec(t0), PhaseTimer(torch.device("cpu"), enabled=False))
    prompt = []
    for layer in range(LAYERS):
        kl = k if k is not None else torch.randn(B, HKV, t0, D, generator=g)
        v = torch.randn(B, HKV, t0, D, generator=g)
        system.prefill(layer, kl.clone(), v.clone())
        prompt.append((kl, v))
    system.end_prefill(t0)
    return system, prompt


def test_keys_of_a_known_rank_are_rebuilt_exactly_at_their_positions():
    g = torch.Generator().manual_seed(0)
    k = known_rank_keys(200, 5, g)
    assert torch.allclose(rotate(unrotate(k, INV_FREQ)), k, atol=1e-5)
    U, SV = low_rank(unrotate(k, INV_FREQ), 5)
    seq, head = torch.tensor([0, 1, 1]), torch.tensor([1, 0, 1])
    pos = torch.tensor([[0, 1, 2], [97, 98, 99], [197, 198, 199]])
    exact = k[seq[:, None], head[:, None], pos]
    assert torch.allclose(rebuild(U, SV, seq, head, pos, INV_FREQ), exact, atol=1e-4)
    U, SV = low_rank(unrotate(k, INV_FREQ), 4)  # one rank short: no longer exact
    assert not torch.allclose(rebuild(U, SV, seq, head, pos, INV_FREQ), exact, atol=1e-2)


def test_the_system_attends_rebuilt_keys_of_a_known_rank_as_the_exact_ones():
    """Through prefill and decode: every selected chunk's rows are the prompt's keys and values."""
    g = torch.Generator().manual_seed(1)
    k = known_rank_keys(256, 3, g)
    system, prompt = built(256, g, k, budget=64, rank=3, outlier_chunks=2, local_chunks=1)
    system.begin_step()
    for layer in range(LAYERS):
        q, kn, vn = torch.randn(B, HQ, D, generator=g), *torch.randn(2, B, HKV, D, generator=g)
        system.decode(layer, q, kn, vn)
        chunks = system.selected_chunks[layer]
        pos = (chunks[..., None] * 8 + torch.arange(8)).flatten(2)  # [B, HKV, 64]
        for kept, x in zip((system.sel_k[layer], system.sel_v[layer]), prompt[layer]):
            assert torch.allclose(kept, x.gather(2, pos[..., None].expand(-1, -1, -1, D)), atol=1e-4)
    system.end_step()


@pytest.mark.parametrize("dense_layers", [0, 1])
def test_with_every_chunk_in_budget_and_full_rank_decode_is_dense_attention(dense_layers):
    t0, g = 203, torch.Generator().manual_seed(2)  # 25 chunks and 3 tokens: the tail joins the local window
    system, prompt = built(t0, g, budget=8 * 25, rank=HKV * D, outlier_chunks=3, local_chunks=2,
                           dense_layers=dense_layers)  # fmt: skip
    geo = system.g
    assert (geo.context, geo.local, geo.outliers, geo.select) == (16, 75, 3, 13)  # 23 chunks rounded to 16
    new = [[], []]
    for _ in range(3):
        system.begin_step()
        for layer in range(LAYERS):
            q, kn, vn = torch.randn(B, HQ, D, generator=g), *torch.randn(2, B, HKV, D, generator=g)
            new[layer].append((kn, vn))
            out = system.decode(layer, q, kn, vn)
            k = torch.cat([prompt[layer][0], torch.stack([x for x, _ in new[layer]], 2)], dim=2)
            v = torch.cat([prompt[layer][1], torch.stack([x for _, x in new[layer]], 2)], dim=2)
            assert torch.allclose(out, dense_decode_attention(q, k, v), atol=1e-4)
        system.end_step()


def test_chunks_kept_from_the_last_step_are_neither_rebuilt_nor_fetched():
    g = torch.Generator().manual_seed(3)
    system, _ = built(512, g, budget=64, rank=8, outlier_chunks=4)
    q = torch.randn(B, HQ, D, generator=g)
    stats = []
    for step in range(3):
        system.begin_step()
        for layer in range(LAYERS):
            system.decode(layer, q if step < 2 else -q, *torch.zeros(2, B, HKV, D))
        stats.append(system.end_step())
    chunks = LAYERS * B * HKV * 8
    row = 8 * D * 4  # a chunk's values, fp32
    assert (stats[0].lookups, stats[0].hits, stats[0].bytes_h2d) == (chunks, 0, chunks * row)  # nothing cached yet
    assert (stats[1].hits, stats[1].bytes_h2d) == (chunks, 0)  # the same query: the same chunks
    assert stats[2].hits < chunks and stats[2].bytes_h2d == (chunks - stats[2].hits) * row


def test_an_outlier_is_the_chunk_its_landmark_stands_for_worst():
    g = torch.Generator().manual_seed(4)
    k = torch.randn(1, 2, 10, 1, D, generator=g).expand(-1, -1, -1, 8, -1).clone()  # each chunk one key, repeated
    k += 0.01 * torch.randn(k.shape, generator=g)
    k[0, 0, 6, 3] *= -1  # one key of chunk 6 of head 0 turned away from its chunk's mean
    k[0, 1, 2, 5] *= -1
    lm, rest, out = landmarks_and_outliers(k.view(1, 2, 80, D), 8, 1)
    assert out.tolist() == [[[6], [2]]]
    assert rest[0, 0].tolist() == [0, 1, 2, 3, 4, 5, 7, 8, 9] and lm.shape == (1, 2, 9, D)
    assert torch.allclose(lm[0, 1, 0], k[0, 1, 0].mean(0))


def test_the_originals_geometry_and_a_budget_from_the_ratio():
    """At 128K the original's defaults: 48 outlier chunks, 256 selected, 4 local chunks; with topk_ratio a head
    attends as many prompt tokens as the other systems, less than a chunk short. (The context rounds down to 8 chunks:
    the local window is 4 to 11 chunks and the prompt's tail.)"""
    geo = geometry(131072, 8, 4, 2048, None, None)
    assert (geo.context, geo.local, geo.outliers, geo.select) == (16376, 64, 48, 256)  # 16380 chunks, rounded
    for t0 in (3000, 131072):
        geo = geometry(t0, 8, 4, 2048, 0.1, None)
        attended = geo.local + (geo.outliers + geo.select) * 8
        assert math.ceil(0.1 * t0) - 8 < attended <= math.ceil(0.1 * t0)
        assert geo.outliers == outlier_rule(geo.budget, None) and geo.select * 8 == geo.budget
    assert outlier_rule(2048, None) == 48 and outlier_rule(1536, None) == 24  # the original's rule from 1024 up
    assert geometry(3000, 8, 4, 2048, 0.1, None).outliers == 5  # its share below: ceil(200 * 24 / 1024)


@pytest.mark.parametrize(
    "settings, t0, message",
    [
        ({"rank": 0}, 512, "rank=0"),
        ({"rank": HKV * D + 1}, 512, f"rank={HKV * D + 1} exceeds the keys' {HKV * D} columns"),
        ({"budget": 60}, 512, "budget=60 must be a positive multiple of chunk_size=8"),
        ({"topk_ratio": 0.05, "outlier_chunks": 4, "rank": 8}, 512, "below the outliers and local window"),
        ({"rank": 8}, 7, "a prompt of 7 tokens is shorter than one chunk"),
    ],
)
def test_bad_input_is_refused_before_any_allocation(settings, t0, message):
    with pytest.raises(ConfigError, match=message):
        ShadowKV(**settings).estimate_parts(spec(t0))  # what the preflight asks before anything is allocated


def test_a_spec_without_the_models_rope_is_refused():
    from dataclasses import replace

    with pytest.raises(ConfigError, match="rope_inv_freq"):
        ShadowKV(rank=8).allocate(replace(spec(512), rope_inv_freq=None))


def test_the_probe_sees_the_window_outliers_and_selected_chunks():
    g = torch.Generator().manual_seed(5)
    system, _ = built(512, g, budget=64, rank=8, outlier_chunks=4)
    system.keep_selections()
    system.begin_step()
    for layer in range(LAYERS):
        system.decode(layer, torch.randn(B, HQ, D, generator=g), *torch.zeros(2, B, HKV, D))
    system.end_step()
    geo = system.g
    assert system.always_attended(512) == (0, geo.local)
    pos = system.attended_positions(1)
    assert pos.shape == (B, HKV, geo.local + (4 + 8) * 8)
    assert sorted(pos[0, 0, : geo.local].tolist()) == list(range(512 - geo.local, 512))
    chunks = torch.cat([system.outlier_ids[1], system.selected_chunks[1]], 2)
    assert (pos[..., geo.local :].view(B, HKV, -1, 8)[..., 0] == chunks * 8).all()
    assert all(len(set(p.tolist())) == p.numel() for p in pos.view(-1, pos.shape[-1]))  # each position once


def test_slot_assignment_keeps_held_chunks_in_place():
    old = torch.tensor([[5, 3, 9, -1], [-1, -1, -1, -1], [1, 2, 3, 4]])
    held, miss = slot_assignment(old, torch.tensor([[3, 7, 5, 2], [8, 6, 4, 2], [4, 3, 2, 1]]))
    assert held.tolist() == [[5, 3, 7, 2], [8, 6, 4, 2], [1, 2, 3, 4]]
    assert miss.tolist() == [[False, False, True, True], [True] * 4, [False] * 4]
    g = torch.Generator().manual_seed(6)
    old = torch.stack([torch.randperm(40, generator=g)[:16] for _ in range(50)])
    new = torch.stack([torch.randperm(40, generator=g)[:16] for _ in range(50)])
    held, miss = slot_assignment(old, new)
    assert (held.sort(-1).values == new.sort(-1).values).all()  # it holds what was selected
    assert (held[~miss] == old[~miss]).all()  # a kept chunk stays in its slot
    assert ((old[..., :, None] == new[..., None, :]).any(-1) == ~miss).all()  # refilled: the chunks let go


@pytest.mark.parametrize("dense_layers", [0, 1])
def test_the_static_path_attends_what_the_reference_does(dense_layers):
    """CUDA's path (fixed shapes, slots kept in place, UVA reads; on the CPU its gather reference) against the
    reference: the same outputs, chunks, hits and bytes, step after step."""
    settings = {"budget": 64, "rank": 8, "outlier_chunks": 4, "dense_layers": dense_layers}
    ref, _ = built(512, torch.Generator().manual_seed(7), path="reference", **settings)
    static, _ = built(512, torch.Generator().manual_seed(7), path="static", **settings)
    g = torch.Generator().manual_seed(8)
    q = torch.randn(B, HQ, D, generator=g)
    for step in range(4):
        q = q + 0.5 * torch.randn(B, HQ, D, generator=g)  # some chunks stay selected, others change
        kv = torch.randn(LAYERS, 2, B, HKV, D, generator=g)
        outs = []
        for system in (ref, static):
            system.begin_step()
            outs.append([system.decode(layer, q, *kv[layer]) for layer in range(LAYERS)])
        a, b = ref.end_step(), static.end_step()
        assert (a.lookups, a.hits, a.bytes_h2d) == (b.lookups, b.hits, b.bytes_h2d)
        assert 0 < a.hits < a.lookups or step == 0
        for x, y in zip(*outs):
            assert torch.allclose(x, y, atol=1e-5)
        for layer in range(dense_layers, LAYERS):
            same = ref.selected_chunks[layer].sort(-1).values == static.selected_chunks[layer].sort(-1).values
            assert same.all()
