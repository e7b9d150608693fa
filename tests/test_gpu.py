"""GPU versions against their CPU references (run on the GPU machine: pytest -m gpu)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from baselines.fullattn import FullAttn, dense_decode_attention
from experiments.runner.timing import link_gb_s
from kvoffload.kv.interface import KVSpec
from kvoffload.kv.timer import PhaseTimer
from kvoffload.model.config import ModelConfig
from kvoffload.model.decoder import Decoder
from tests.tiny_models import tiny_config

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
TINY = tiny_config(
    name="tiny",
    hidden_size=512,
    intermediate_size=1024,
    num_layers=4,
    num_heads=8,
    head_dim=64,
    vocab_size=2000,
    max_position_embeddings=4096,
)


def cuda_spec(*shape_and_dtype) -> KVSpec:
    """A CUDA KVSpec with the link measured, as the runner hands it to a system."""
    return KVSpec(*shape_and_dtype, CUDA, link_gb_s=link_gb_s(CUDA))


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


@pytest.mark.parametrize("topk_ratio", [0.1, 1.0])
def test_clo_graph_replay_generates_the_eager_tokens(topk_ratio):
    """The whole CLO step (lookup, retrieval, UVA transfer on the side stream, hybrid attention) replayed from a
    CUDA graph gives the eager tokens; at top-k 100% both give FullAttn's; no host sync inside a step."""
    from clo.system import CLO
    from kvoffload.generate import generate
    from kvoffload.model.weights import synthetic_decoder

    model = synthetic_decoder(TINY, 0, CUDA, torch.bfloat16)
    prompt = torch.randint(0, 2000, (2, 1000), device=CUDA)
    runs, stats = [], []
    for graph in (False, True):
        kv = CLO(topk_ratio=topk_ratio, dense_layers=1, layer_time_ms=0.1)
        kv.allocate(cuda_spec(4, 2, 1040, 8, 2, 64, torch.bfloat16), PhaseTimer(CUDA, enabled=not graph))
        gen = generate(model, kv, prompt, 40, decode_mode="graph" if graph else "eager")
        runs.append(gen.tokens)
        stats.append(gen.steps)
    assert torch.equal(runs[0], runs[1])
    assert all(s.host_syncs == 0 for s in stats[1]) and sum(s.lookups for s in stats[1]) > 0
    if topk_ratio == 1.0:  # one teacher-forced step of each: bf16 logits agree to rounding
        logits = []
        for kv in (CLO(topk_ratio=1.0, dense_layers=1, layer_time_ms=0.1), FullAttn()):
            kv.allocate(cuda_spec(4, 2, 1040, 8, 2, 64, torch.bfloat16), PhaseTimer(CUDA))
            model.prefill(prompt, kv)
            kv.begin_step()
            logits.append(model.decode(prompt[:, -1], kv.position, kv).float())
            kv.end_step()
        assert (logits[0] - logits[1]).norm() / logits[1].norm() < 2e-2


def test_clo_side_stream_reads_its_own_query():
    """Queries that never change (a query process with rho = 1) hit every lookup after the first step, in a
    replayed graph too: the side stream's lookups read the speculative query they were given, not memory the
    compute stream has since reused (a race that lowered the hit rate at 128K: results/LEDGER.md, row
    429bbc0_race)."""
    from clo.system import CLO
    from experiments.workloads.query_process import ProfileQueryProcess
    from kvoffload.generate import generate
    from kvoffload.model.weights import synthetic_decoder

    model = synthetic_decoder(TINY, 0, CUDA, torch.bfloat16)
    model.query_process = ProfileQueryProcess(torch.ones(4, 2), 4, CUDA, "rho = 1")
    prompt = torch.randint(0, 2000, (1, 30000), device=CUDA)
    kv = CLO(dense_layers=1, layer_time_ms=0.1)
    kv.allocate(cuda_spec(4, 1, 30040, 8, 2, 64, torch.bfloat16), PhaseTimer(CUDA, enabled=False))
    steps = generate(model, kv, prompt, 24, decode_mode="graph").steps
    assert steps[0].hits == 0 and all(s.lookups > 0 and s.hits == s.lookups for s in steps[1:])


@pytest.mark.parametrize("mode", ["overlap", "one_launch", "speculative"])
def test_clo_persistent_heads_overlapped_attention(tmp_path, mode):
    """With a persistent and a cached KV head per layer (a profile that makes one head hard, a link too slow to
    prefetch it), decode's overlapped attention (the cached head's part on its own stream while the persistent
    head's top-k is selected, then one merge) equals one launch over every head, and graph replay gives the
    eager tokens; also with the persistent head selected one layer ahead (persist_query=speculative)."""
    from clo.system import CLO
    from kvoffload.generate import generate
    from kvoffload.model.weights import synthetic_decoder
    from tests.reference import first_head_hard, write_profile

    profile = write_profile(tmp_path / "one_hard_head.json", first_head_hard(TINY.num_layers, 2))
    model = synthetic_decoder(TINY, 0, CUDA, torch.bfloat16)
    prompt = torch.randint(0, 2000, (2, 3000), device=CUDA)
    runs = []
    for graph in (False, True):
        # torch.topk: the radix select returns its indices in an order that varies from run to run (blocks
        # claim output places by atomics), and attention sums the rows in that order; the bf16 rounding of
        # the sums then differs, and greedy tokens of a random model follow (graph and eager differed with it:
        # results/LEDGER.md, row 6b386b6_radix_order)
        kv = CLO(
            dense_layers=1,
            profile=profile,
            layer_time_ms=0.1,
            link_gb_s=1e-3,
            topk="torch",
            persist_query="speculative" if mode == "speculative" else "real",
        )
        kv.allocate(cuda_spec(4, 2, 3040, 8, 2, 64, torch.bfloat16), PhaseTimer(CUDA, enabled=not graph))
        if mode == "one_launch":
            kv.attn_stream = None  # every head in one launch after the top-k
        runs.append(generate(model, kv, prompt, 24, decode_mode="graph" if graph else "eager").tokens)
    differ = (runs[0] != runs[1]).any(0).nonzero()
    assert torch.equal(runs[0], runs[1]), f"first differing step {differ[0].item() if len(differ) else None}"
    st = kv.stores[1]
    assert st.nc == 1 and st.persist is not None and st.persist.shape[1] == 1
    if mode != "overlap":
        return  # without attn_stream, or with the selection made ahead, attend is st.attend itself
    q = torch.randn(2, 8, 64, device=CUDA, dtype=torch.bfloat16)
    got = kv.attend(1, q, None).float()
    want = st.attend(q, kv.win_len, st.select_persistent(st.permute_q(q), kv.retriever, 1)).float()
    assert not got.isnan().any() and (got - want).norm() / want.norm() < 1e-3
