"""The preflight's estimate of the prefill's transient memory (experiments.runner.preflight.prefill_peak_bytes) against
the peak the prefill really reaches, measured from the CPU allocator's events (torch profiler, profile_memory):
every tensor the prefill and its kernels allocate and free, in order."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from baselines.fullattn import FullAttn
from clo.system import CLO
from experiments.runner import preflight
from kvoffload.kv.interface import KVSpec
from kvoffload.model.weights import synthetic_decoder
from tests.tiny_models import tiny_config

CPU = torch.device("cpu")
CFG = tiny_config(
    hidden_size=256, intermediate_size=768, num_layers=3, head_dim=64, vocab_size=97, max_position_embeddings=8192
)


@pytest.fixture(scope="module")
def model():
    return synthetic_decoder(CFG, 0, CPU, torch.float32)


@pytest.fixture
def one_thread():
    """CPU attention allocates a buffer per thread: one thread keeps the measurement the same on any machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def measured(fn) -> tuple[int, int]:
    """(peak, still held at the end) bytes of the CPU tensors allocated while fn runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak, live


def run(model, system, batch: int, t: int, chunk: int) -> tuple[int, int]:
    system.allocate(KVSpec(CFG.num_layers, batch, t + 8, 4, 2, 64, torch.float32, CPU, prompt_len=t))
    model.prefill_chunk = chunk
    tokens = torch.randint(0, CFG.vocab_size, (batch, t), generator=torch.Generator().manual_seed(t))
    return measured(lambda: model.prefill(tokens, system))


def staging(batch: int, t: int) -> int:
    """The estimate's staged copy of one layer's K/V (the systems' own: FullAttn has none)."""
    return batch * t * 2 * CFG.num_kv_heads * CFG.head_dim * 4


@pytest.mark.parametrize("batch,t,chunk", [(1, 2048, 128), (1, 4096, 128), (2, 2048, 256), (1, 1000, 2048)])
def test_the_estimate_is_fullattns_measured_peak_plus_the_staging(model, one_thread, batch, t, chunk):
    """FullAttn allocates its cache before the prefill and stages nothing: its prefill's peak is the decoder's
    alone, which the estimate less its staging term must match to a few percent (from below: the CPU kernels'
    small workspaces are WORKSPACE_BYTES's). An estimate that still counted the whole prompt's q and attention
    output, or a prefill that still made them, fails here."""
    peak, _ = run(model, FullAttn(), batch, t, chunk)
    est = preflight.prefill_peak_bytes(CFG, t, batch, 4, chunk)
    assert peak <= est
    assert abs(peak - (est - staging(batch, t))) < 0.05 * peak, (peak, est)


def test_the_peak_grows_with_the_prompt_by_what_is_resident_only(model, one_thread):
    """Twice the prompt at the same chunk: the peak grows by the residual stream, the layer's K/V and the CPU
    path's causal mask (bool and float, MASKED_ROWS rows), not by anything per chunk."""
    from kvoffload.model.chunk_attention import MASKED_ROWS

    (short, _), (long, _) = (run(model, FullAttn(), 1, t, 128) for t in (2048, 4096))
    per_token = (CFG.hidden_size + 2 * CFG.num_kv_heads * CFG.head_dim) * 4 + 5 * min(128, MASKED_ROWS)
    assert abs((long - short) - 2048 * per_token) < 0.02 * (long - short)


@pytest.mark.parametrize("batch,t,chunk", [(1, 2048, 128), (2, 2048, 256)])
def test_clos_prefill_stays_within_its_held_memory_and_the_estimate(model, one_thread, batch, t, chunk):
    """What the preflight promises a run: its peak is at most the KV system's parts (held after the prefill)
    plus the estimate. CLO stages each layer's K/V in its store's head order, the estimate's staging term; on
    the CPU it is let go before the next layer's chunks, on CUDA it is held through them (test_prefill_gpu.py).
    (The oracle retriever: the hash encoding's chunked temporaries are WORKSPACE_BYTES's.)"""
    system = CLO(layer_time_ms=0.1, dense_layers=1, retriever="exact")
    peak, held = run(model, system, batch, t, chunk)
    assert peak <= held + preflight.prefill_peak_bytes(CFG, t, batch, 4, chunk)


def test_the_hash_encoding_works_in_bounded_chunks(one_thread):
    """HashRetriever.index's temporaries do not grow with the prompt."""
    from kvoffload.offload.retrieval import HashRetriever

    r = HashRetriever(1, 2, 64, CPU, rbit=256)
    extra = []
    for t in (4096, 16384):
        keys = torch.randn(1, 2, t, 64)
        peak, held = measured(lambda keys=keys: r.index(0, keys, rows=2048))
        extra.append(peak - held)  # held: the codes and norms
    assert extra[1] < 1.5 * extra[0]  # in one piece: 4x


@pytest.mark.parametrize("batch,t,chunk", [(1, 2048, 128), (2, 2048, 256), (3, 1000, 2048)])
def test_the_kv_fill_stays_within_its_estimate(model, one_thread, batch, t, chunk):
    """workload.kv_fill=projection (Decoder.fill): its peak is bounded by fill_peak_bytes, which counts the staged
    copy FullAttn does not make, and is matched to within 15 % without it."""
    system = FullAttn()
    system.allocate(KVSpec(CFG.num_layers, batch, t + 8, 4, 2, 64, torch.float32, CPU, prompt_len=t))
    model.prefill_chunk = chunk
    tokens = torch.randint(0, CFG.vocab_size, (batch, t), generator=torch.Generator().manual_seed(t))
    peak, _ = measured(lambda: model.fill(tokens, system))
    est = preflight.fill_peak_bytes(CFG, t, batch, 4, chunk)
    assert peak <= est
    assert abs(peak - (est - staging(batch, t))) < 0.15 * peak, (peak, est)
