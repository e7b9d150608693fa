"""The chunked prefill and CLO's overlapped offload on CUDA (pytest -m gpu on the GPU machine): the flash path
takes the causal offset, results equal the CPU-style references, the peak memory stays within the preflight's
estimate, no host sync happens before the offload's own waits, and CLO's prefill keeps up with FullAttn's."""

import time

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from baselines.fullattn import FullAttn
from clo.system import CLO
from experiments.runner import preflight
from experiments.runner.timing import link_gb_s
from kvoffload.kv.interface import KVSpec
from kvoffload.kv.timer import PhaseTimer
from kvoffload.model import chunk_attention
from kvoffload.model.chunk_attention import (
    _cudnn_attend,
    _cudnn_split_usable,
    _flash_usable,
    causal_attention,
    split_causal_attention,
)
from kvoffload.model.config import ModelConfig
from kvoffload.model.weights import synthetic_decoder
from tests.tiny_models import tiny_config

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def shapes(layers: int, hidden: int = 4096, inter: int = 14336, heads: int = 32, kv_heads: int = 8) -> ModelConfig:
    """Llama-3-8B's layer shapes by default, with fewer layers."""
    return tiny_config(
        name="llama3-shapes",
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=128,
        vocab_size=2000,
        rope_theta=5e5,
        max_position_embeddings=1 << 20,
    )


def spec(cfg: ModelConfig, t: int, batch: int = 1) -> KVSpec:
    return KVSpec(
        cfg.num_layers,
        batch,
        t + 16,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        torch.bfloat16,
        CUDA,
        prompt_len=t,
        link_gb_s=link_gb_s(CUDA),
        layer_time_s=1e-3,
    )


def chunk_inputs(start: int, c: int, seed: int = 0):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    q = torch.randn(1, 32, c, 128, device=CUDA, dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, 8, start + c, 128, device=CUDA, dtype=torch.bfloat16, generator=g)
    return q, k, torch.randn_like(k)


def flash_chunk(q, k, v):
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]), enable_gqa=True
    )


@pytest.mark.parametrize("path", ["split", "flash"])
def test_a_chunk_matches_the_masked_softmax_on_either_fast_path(path):
    """On Hopper causal_attention takes the split path (cuDNN, two calls merged by log-sum-exp), elsewhere on CUDA
    flash attention 2; both must give the masked softmax."""
    start, c = 3000, 1000
    q, k, v = chunk_inputs(start, c)
    if path == "split":
        assert _cudnn_split_usable(q, k, v, start), "cuDNN attention unusable here: the prefill runs flash attention 2"
        got = split_causal_attention(q, k, v, start, _cudnn_attend)
        if chunk_attention.CUDNN_SPLIT:  # the path causal_attention takes when it is switched on
            assert torch.equal(causal_attention(q, k, v, start), got)
    else:
        assert _flash_usable(q, k, v)
        got = flash_chunk(q, k, v)
    qf, kf, vf = q.float(), k.float().repeat_interleave(4, 1), v.float().repeat_interleave(4, 1)
    scores = qf @ kf.transpose(-1, -2) / 128**0.5
    future = torch.arange(start + c, device=CUDA)[None, :] > torch.arange(start, start + c, device=CUDA)[:, None]
    want = scores.masked_fill(future, float("-inf")).softmax(-1) @ vf
    assert (got.float() - want).abs().max() < 2e-2


def test_the_split_path_is_faster_than_flash_attention_2():
    """The last chunk of a 128K prompt at Llama-3-8B's heads: the reason the split path is taken on Hopper."""
    start, c = 131072 - 8192, 8192
    q, k, v = chunk_inputs(start, c)
    if not _cudnn_split_usable(q, k, v, start):
        pytest.skip("cuDNN attention unusable here")
    ms = {}
    for name, fn in (
        ("split", lambda: split_causal_attention(q, k, v, start, _cudnn_attend)),
        ("flash", lambda: flash_chunk(q, k, v)),
    ):
        fn()  # plans and modules built
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(5):
            fn()
        end.record()
        end.synchronize()
        ms[name] = begin.elapsed_time(end) / 5
    print(f"last 8K chunk of 128K: split (cuDNN) {ms['split']:.2f} ms, flash attention 2 {ms['flash']:.2f} ms")
    assert ms["split"] < 0.9 * ms["flash"]


def test_chunked_prefill_on_cuda_equals_one_chunk():
    cfg = shapes(2, hidden=1024, inter=2816, heads=8, kv_heads=2)
    model = synthetic_decoder(cfg, 0, CUDA, torch.bfloat16)
    tokens = torch.randint(0, 2000, (2, 3000), device=CUDA, generator=torch.Generator(device=CUDA).manual_seed(1))
    logits = []
    for chunk in (3000, 512, 700):
        model.prefill_chunk = chunk
        kv = FullAttn()
        kv.allocate(spec(cfg, 3000, 2))
        logits.append(model.prefill(tokens, kv, all_logits=True))
    for other in logits[1:]:
        assert (other - logits[0]).norm() / logits[0].norm() < 1e-2


@pytest.mark.parametrize("system", ["fullattn", "clo"])
def test_the_prefill_peak_stays_within_the_estimate(system):
    """torch.cuda.max_memory_allocated over the prefill, less what stays allocated after it (the system's own
    stores), is the prefill's transient peak: at most the preflight's activation estimate, and not far below
    its tensor part (an estimate of the whole prompt's q and attention output would be)."""
    cfg, t, chunk = shapes(4), 32768, 4096
    model = synthetic_decoder(cfg, 0, CUDA, torch.bfloat16)
    model.prefill_chunk = chunk
    kv = FullAttn() if system == "fullattn" else CLO(dense_layers=1)
    kv.allocate(spec(cfg, t), PhaseTimer(CUDA))
    tokens = torch.randint(0, 2000, (1, t), device=CUDA)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    model.prefill(tokens, kv)
    torch.cuda.synchronize()
    transient = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
    tensors = preflight.prefill_peak_bytes(cfg, t, 1, 2, chunk)
    print(f"{system}: transient {transient / 2**20:.0f} MiB, estimate {tensors / 2**20:.0f} MiB (+ workspace)")
    assert transient <= preflight.activation_bytes(cfg, t, 1, 2, chunk)
    assert transient >= 0.6 * tensors


def test_clo_prefill_syncs_with_the_host_only_for_its_offload_and_stores_what_it_was_handed():
    """Under torch's sync debug mode a host sync inside the prefill raises, outside the offload's own waits for
    its event. The stores then hold the handed K/V in store order and the codes of their keys, as a synchronous
    encoding makes them."""
    cfg = shapes(4, hidden=1024, inter=2816)
    model = synthetic_decoder(cfg, 0, CUDA, torch.bfloat16)
    model.prefill_chunk = 1024
    tokens = torch.randint(0, 2000, (1, 4096), device=CUDA)
    warm = FullAttn()  # the kernels' first launches (Triton compiles) before the sync check
    warm.allocate(spec(cfg, 4096))
    model.prefill(tokens, warm)
    kv = CLO(dense_layers=1)
    kv.allocate(spec(cfg, 4096), PhaseTimer(CUDA))
    handed = {}
    original = kv.prefill

    def keep(layer, k, v):
        handed[layer] = (k.clone(), v.clone())
        original(layer, k, v)

    kv.prefill = keep
    wait = kv.offload.finish

    def finish():  # the one host sync the prefill may make
        torch.cuda.set_sync_debug_mode("default")
        wait()
        torch.cuda.set_sync_debug_mode("error")

    kv.offload.finish = finish
    torch.cuda.set_sync_debug_mode("error")
    try:
        model.prefill(tokens, kv)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for layer in range(1, cfg.num_layers):
        st = kv.stores[layer]
        order = st.order.tolist()
        k, v = handed[layer]
        assert torch.equal(st.host, torch.stack([k, v], dim=3)[:, order].cpu())
        mid = k[:, order, st.sink : st.sink + st.n_mid]
        assert torch.equal(kv.retriever.codes[layer], kv.retriever.encode(layer, mid))


def test_the_staged_kv_outlives_its_copy():
    """Right after a layer's prefill the compute stream fills fresh tensors of the staged K/V's size: had the
    staged K/V been freed before its copy ran, the allocator would hand its memory to them."""
    cfg = shapes(3, hidden=1024, inter=2816)
    kv = CLO(dense_layers=1)
    kv.allocate(spec(cfg, 65536), PhaseTimer(CUDA))
    g = torch.Generator(device=CUDA).manual_seed(2)
    shape = (1, cfg.num_kv_heads, 65536, 128)
    ks = [torch.randn(shape, device=CUDA, dtype=torch.bfloat16, generator=g) for _ in range(3)]
    vs = [torch.randn(shape, device=CUDA, dtype=torch.bfloat16, generator=g) for _ in range(3)]
    busy = torch.randn(4096, 4096, device=CUDA)
    for layer in range(3):
        for _ in range(50):  # the offload stream starts behind this
            busy = busy @ busy / 64
        kv.prefill(layer, ks[layer], vs[layer])
        _ = [torch.full((1, 8, 65536, 2, 128), float("nan"), device=CUDA, dtype=torch.bfloat16) for _ in range(4)]
    kv.end_prefill(65536)
    for layer in (1, 2):
        order = kv.stores[layer].order.tolist()
        assert torch.equal(kv.stores[layer].host, torch.stack([ks[layer], vs[layer]], dim=3)[:, order].cpu())


@pytest.mark.parametrize("t", [32768, 131072])
def test_clos_prefill_keeps_up_with_fullattns(t):
    """The prefill target at Llama-3-8B's layer shapes (8 layers: 1 dense, 7 offloaded, as 30 of 32), B=1: CLO's
    prefill at least 0.8x FullAttn's tokens/s, its host stores allocated (pinned) before, as the runner does."""
    cfg = shapes(8)
    model = synthetic_decoder(cfg, 0, CUDA, torch.bfloat16)
    tokens = torch.randint(0, 2000, (1, t), device=CUDA)
    seconds = {}
    # the first of each warms up: Triton's compiles, cuDNN's plans (one per prefix length) are made once a process
    for name in ("fullattn", "clo", "fullattn", "clo"):
        kv = FullAttn() if name == "fullattn" else CLO(dense_layers=1)
        kv.allocate(spec(cfg, t), PhaseTimer(CUDA))
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.prefill(tokens, kv)
        torch.cuda.synchronize()
        seconds[name] = time.perf_counter() - start
        del kv
    ratio = seconds["fullattn"] / seconds["clo"]
    print(f"prefill at {t}: fullattn {seconds['fullattn']:.3f} s, clo {seconds['clo']:.3f} s, clo/fullattn {ratio:.2f}")
    assert ratio >= 0.8
