"""GPU versions against their CPU references (run on the GPU machine: pytest -m gpu): FullAttn's decode
backends and graph replays, the decoder against transformers, graph and piecewise decoding giving the eager
tokens, and RetroInfer- and InfiniGen-style's per-layer graphs and worker fetch against their eager steps
(UVA reads of pinned memory: tests/test_uva_gpu.py; CLO's graphs and streams: tests/test_clo_gpu.py)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from baselines.fullattn import FullAttn, dense_decode_attention
from kvoffload.kv.timer import PhaseTimer
from kvoffload.model.config import ModelConfig
from kvoffload.model.decoder import Decoder
from tests.gpu_helpers import CUDA, TINY, cuda_spec

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["sdpa", "flashinfer", "triton"])
@pytest.mark.parametrize("length", [1000, 32768])
def test_fullattn_decode_matches_reference(backend, length):
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    b, h, hkv, d, layers = 2, 32, 8, 128, 2
    g = torch.Generator(device=CUDA).manual_seed(0)
    kv = FullAttn(attention_backend=backend)
    kv.allocate(cuda_spec(layers, b, length + 1, h, hkv, d, torch.bfloat16), PhaseTimer(CUDA))
    k = torch.randn(layers, b, hkv, length, d, device=CUDA, dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    for layer in range(layers):
        kv.prefill(layer, k[layer], v[layer])
    kv.end_prefill(length)
    kv.begin_step()
    q = torch.randn(b, h, d, device=CUDA, dtype=torch.bfloat16, generator=g)
    k1, v1 = (
        torch.randn(b, hkv, d, device=CUDA, dtype=torch.bfloat16, generator=g),
        torch.randn(b, hkv, d, device=CUDA, dtype=torch.bfloat16, generator=g),
    )
    out = kv.decode(1, q, k1, v1)
    stats = kv.end_step()
    assert kv.backend == backend and stats.phase_ms["attention"] > 0
    ref = dense_decode_attention(
        q.float().cpu(),
        torch.cat([k[1], k1[:, :, None]], 2).float().cpu(),
        torch.cat([v[1], v1[:, :, None]], 2).float().cpu(),
    )
    assert not out.isnan().any()
    rel = (out.float().cpu() - ref).norm() / ref.norm()
    assert rel < 1e-2, rel


@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_fullattn_graph_replays_match_reference_across_pages(backend):
    """One layer's decode captured once in a CUDA graph, replayed over 40 steps that cross page boundaries
    (16-token pages from 1000 tokens on): each replay attends exactly the tokens so far."""
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    b, h, hkv, d, t0, n = 2, 32, 8, 128, 1000, 40
    g = torch.Generator(device=CUDA).manual_seed(1)
    kv = FullAttn(attention_backend=backend)
    kv.allocate(cuda_spec(1, b, t0 + n, h, hkv, d, torch.bfloat16), PhaseTimer(CUDA, enabled=False))
    k = torch.randn(b, hkv, t0 + n, d, device=CUDA, dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    q = torch.randn(n, b, h, d, device=CUDA, dtype=torch.bfloat16, generator=g)
    kv.prefill(0, k[:, :, :t0], v[:, :, :t0])
    kv.end_prefill(t0)
    kv.use_static_shapes()
    sq, sk, sv = q[0].clone(), k[:, :, t0].clone(), v[:, :, t0].clone()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    for i in range(n):
        kv.begin_step()
        sq.copy_(q[i]), sk.copy_(k[:, :, t0 + i]), sv.copy_(v[:, :, t0 + i])
        if i < 2:  # warm-up steps eager (library state), then capture once
            out = kv.decode(0, sq, sk, sv)
        elif i == 2:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.graph(graph, stream=stream):
                out = kv.decode(0, sq, sk, sv)
            torch.cuda.current_stream().wait_stream(stream)
            graph.replay()
        else:
            graph.replay()
        kv.end_step()
        end = t0 + i + 1
        ref = dense_decode_attention(q[i].float(), k[:, :, :end].float(), v[:, :, :end].float())
        rel = (out.float() - ref).norm() / ref.norm()
        assert rel < 1e-2, (i, rel)
    assert kv.backend == backend


def test_decoder_on_cuda_matches_transformers():
    torch.manual_seed(0)
    hf = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=1000,
        rope_theta=500000.0,
    )
    ref = LlamaForCausalLM(hf).eval()
    ours = Decoder(ModelConfig.from_hf(ref.config.to_dict(), "tiny"))
    ours.load_state_dict(ref.state_dict(), strict=False)
    ours = ours.to(CUDA).eval()
    ids = torch.randint(0, 1000, (2, 300))
    with torch.no_grad():
        want = ref(ids).logits
    kv = FullAttn()
    kv.allocate(cuda_spec(4, 2, 301, 8, 2, 32, torch.float32), PhaseTimer(CUDA))
    got = ours.prefill(ids[:, :299].to(CUDA), kv, all_logits=True).cpu()
    torch.testing.assert_close(got, want[:, :299], atol=2e-3, rtol=1e-3)
    kv.begin_step()
    last = ours.decode(ids[:, 299].to(CUDA), kv.position, kv).cpu()
    kv.end_step()
    torch.testing.assert_close(last, want[:, 299], atol=2e-3, rtol=1e-3)


def test_cuda_graph_decode_generates_the_eager_tokens():
    from kvoffload.generate import generate
    from kvoffload.model.weights import synthetic_decoder

    model = synthetic_decoder(TINY, 0, CUDA, torch.float32)
    prompt = torch.randint(0, 2000, (2, 500), device=CUDA)
    runs = []
    for graph in (False, True):
        kv = FullAttn()
        kv.allocate(cuda_spec(4, 2, 540, 8, 2, 64, torch.float32), PhaseTimer(CUDA, enabled=not graph))
        runs.append(generate(model, kv, prompt, 40, decode_mode="graph" if graph else "eager").tokens)
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("system", ["fullattn", "clo", "retroinfer", "infinigen", "pqcache"])
def test_piecewise_graphs_generate_the_eager_tokens(system):
    """Only the dense model replayed from per-layer graphs, the system eager (and phase-timed): the eager tokens,
    for a system that is capturable whole, one with a speculative query and two that sync with the host."""
    from baselines.infinigen import InfiniGen
    from baselines.pqcache import PQCache
    from baselines.retroinfer import RetroInfer
    from clo.system import CLO
    from kvoffload.generate import generate
    from kvoffload.model.weights import synthetic_decoder

    make = {
        "fullattn": FullAttn,
        "clo": lambda: CLO(dense_layers=1, layer_time_ms=0.1),
        "retroinfer": lambda: RetroInfer(dense_layers=1),
        "infinigen": lambda: InfiniGen(dense_layers=1),
        "pqcache": lambda: PQCache(dense_layers=1, block_size=16, cache_tokens=128),
    }[system]
    model = synthetic_decoder(TINY, 0, CUDA, torch.float32)
    prompt = torch.randint(0, 2000, (2, 1000), device=CUDA)
    runs = []
    for mode in ("eager", "piecewise"):
        kv = make()
        kv.allocate(cuda_spec(4, 2, 1040, 8, 2, 64, torch.float32), PhaseTimer(CUDA))
        gen = generate(model, kv, prompt, 24, decode_mode=mode)
        runs.append(gen.tokens)
    assert torch.equal(runs[0], runs[1])
    assert gen.steps[-1].phase_ms["total"] > 0


@pytest.mark.parametrize("t0, topk_ratio", [(1000, 0.1), (1003, 0.1), (1003, 1.0)])
def test_retroinfer_graph_step_equals_its_eager_step(t0, topk_ratio):
    """RetroInfer-style's per-layer graphs (retrieve, LRU into pinned buffers, UVA block fetch, split attention
    over window + cache rows) against its eager path, step by step: the same attention output (to bf16 rounding),
    the same hits, lookups and bytes; a middle that is not whole blocks (1003 tokens) and top-k 100 % included.
    The graphs with the LRU's state change deferred to a worker thread give the inline graphs' outputs exactly."""
    from baselines.retroinfer import RetroInfer

    layers, b, h, hkv, d, n = 3, 2, 8, 2, 64, 12
    g = torch.Generator(device=CUDA).manual_seed(2)
    k = torch.randn(layers, b, hkv, t0 + n, d, device=CUDA, dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    q = torch.randn(n, layers, b, h, d, device=CUDA, dtype=torch.bfloat16, generator=g)
    modes = (("off", "inline"), ("on", "inline"), ("on", "deferred"))
    systems = [RetroInfer(topk_ratio=topk_ratio, dense_layers=1, graphs=m, lru_update=u) for m, u in modes]
    for kv in systems:
        kv.allocate(cuda_spec(layers, b, t0 + n, h, hkv, d, torch.bfloat16), PhaseTimer(CUDA))
        for layer in range(layers):
            kv.prefill(layer, k[layer, :, :, :t0], v[layer, :, :, :t0])
        kv.end_prefill(t0)
    assert not systems[0].use_graphs and systems[1].use_graphs and systems[2].lru_worker is not None
    for i in range(n):
        outs, stats = [], []
        for kv in systems:
            kv.begin_step()
            step = [(q[i, lay], k[lay, :, :, t0 + i], v[lay, :, :, t0 + i]) for lay in range(layers)]
            outs.append([kv.decode(lay, *args) for lay, args in enumerate(step)])
            stats.append(kv.end_step())
        for a, c, e in zip(*outs):
            rel = (a.float() - c.float()).norm() / a.float().norm()
            assert rel < 2e-2, (i, rel)
            assert torch.equal(c, e), i
        for f in ("lookups", "hits", "bytes_h2d", "host_syncs"):
            assert getattr(stats[0], f) == getattr(stats[1], f) == getattr(stats[2], f), f
    assert stats[1].lookups > 0 and stats[1].host_syncs == layers - 1
    for layer in range(1, layers):  # the deferred updates leave the inline LRU's state
        systems[2].layer_graphs[layer].updating.result()
        assert torch.equal(systems[1].lru[layer].block_slot, systems[2].lru[layer].block_slot)
        assert torch.equal(systems[1].lru[layer].order(), systems[2].lru[layer].order())


def test_infinigen_worker_fetch_equals_the_gpu_gather_and_its_graphs_the_eager_step():
    """InfiniGen-style's overlapped CPU fetch (worker thread, chunked gather + copy) fetches exactly the rows the
    GPU's own gather does: the same attention output, step after step, with a speculative query each layer. Its
    per-layer graphs (speculation; split attention over window + fetched rows) give that output to bf16 rounding,
    with the same syncs and bytes; the first sparse layer, which no layer speculates for, included."""
    from baselines.infinigen import InfiniGen

    layers, b, h, hkv, d, t0, n = 3, 2, 8, 2, 64, 3000, 6
    g = torch.Generator(device=CUDA).manual_seed(4)
    k = torch.randn(layers, b, hkv, t0 + n, d, device=CUDA, dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    q = torch.randn(n, layers, b, h, d, device=CUDA, dtype=torch.bfloat16, generator=g)
    modes = (("cpu_gather", "off"), ("uva", "auto"), ("cpu_gather", "on"))
    systems = [InfiniGen(dense_layers=1, transfer=t, graphs=m, fetch_chunk_rows=100) for t, m in modes]
    for kv in systems:
        kv.allocate(cuda_spec(layers, b, t0 + n, h, hkv, d, torch.bfloat16), PhaseTimer(CUDA))
        for layer in range(layers):
            kv.prefill(layer, k[layer, :, :, :t0], v[layer, :, :, :t0])
        kv.end_prefill(t0)
    assert [kv.fetcher is not None for kv in systems] == [True, False, True]
    assert [kv.use_graphs for kv in systems] == [False, False, True]
    for i in range(n):
        outs, stats = [], []
        for kv in systems:
            kv.begin_step()
            out = []
            for lay in range(layers):
                if lay + 1 < layers and (i % 2 or lay > 0):  # even steps: layer 1 not speculated for
                    kv.prepare(lay + 1, q[i, lay + 1])
                out.append(kv.decode(lay, q[i, lay], k[lay, :, :, t0 + i], v[lay, :, :, t0 + i]))
            stats.append(kv.end_step())
            outs.append(out)
        for a, c, e in zip(*outs):
            assert torch.equal(a, c)
            rel = (a.float() - e.float()).norm() / a.float().norm()
            assert rel < 2e-2, (i, rel)
        for f in ("host_syncs", "bytes_h2d", "bytes_d2h"):
            assert getattr(stats[0], f) == getattr(stats[2], f), f
    assert set(systems[2].layer_graphs[2].graphs) == {"speculate", "attend"}
    for kv in (systems[0], systems[2]):  # the floor's host part: the gather measured alone
        gather = kv.describe()["cpu_gather_gb_s"]
        assert gather["alone"] > 0 and gather["in_steps"] > 0
        assert gather["alone"] == max(gather["alone_by_threads"].values())  # the best of its threads and all cores
        assert kv.cpu_threads in gather["alone_by_threads"]
