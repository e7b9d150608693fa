"""CLO's prefill: each layer's K/V staged in the store's head order, then copied to host memory and
its keys hash-encoded by kvoffload.offload.host.Offload, on CUDA while the next layer computes. On the CPU the
offload runs in place; here it is also deferred to the latest moment the asynchronous path allows (the next layer's
prefill, or end_prefill), which must leave every store as the synchronous path makes it."""

import pytest
import torch

from clo.system import CLO
from kvoffload.kv.interface import KVSpec
from kvoffload.model.weights import synthetic_decoder
from tests.offload_double import DeferredOffload
from tests.reference import first_head_hard, write_profile
from tests.tiny_models import tiny_config

B, H, HKV, D, L, T0 = 2, 8, 4, 16, 3, 150
CPU = torch.device("cpu")


def clo(tmp_path, prompt_len: int | None = T0, batch: int = B, **kw) -> CLO:
    """Hash retriever, layer 0 dense, KV head 0 of every layer persistent: a store order that permutes the heads."""
    profile = write_profile(tmp_path / "first_head_hard.json", first_head_hard(L, HKV))
    settings = dict(dense_layers=1, persistent=True, profile=profile, layer_time_ms=0.1, link_gb_s=1e-3)
    s = CLO(**{**settings, **kw})
    s.allocate(KVSpec(L, batch, T0 + 8, H, HKV, D, torch.float32, CPU, prompt_len=prompt_len))
    return s


def prompt_kv(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, B, HKV, T0, D, generator=g), torch.randn(L, B, HKV, T0, D, generator=g)


@pytest.mark.parametrize("prompt_len", [T0, None])  # host stores made at allocation / at prefill
def test_the_store_holds_the_prompt_in_store_order_and_the_codes_of_its_keys(tmp_path, prompt_len):
    s = clo(tmp_path, prompt_len)
    k0, v0 = prompt_kv()
    for layer in range(L):
        s.prefill(layer, k0[layer], v0[layer])
    s.end_prefill(T0)
    assert s.stores[0] is None and s.dense.kv[0] is not None
    order = [1, 2, 3, 0]  # the cached heads, then the persistent head 0
    for layer in range(1, L):
        st = s.stores[layer]
        assert st.order.tolist() == order and st.nc == 3
        want = torch.stack([k0[layer], v0[layer]], dim=3)[:, order]
        assert torch.equal(st.host, want)
        assert torch.equal(st.persist, want[:, 3:])
        assert torch.equal(st.window[:, :, : st.sink], want[:, :, : st.sink])
        mid = k0[layer][:, order, st.sink : st.sink + st.n_mid]
        assert torch.equal(s.retriever.codes[layer], s.retriever.encode(layer, mid))
        assert torch.equal(s.retriever.norms[layer], mid.norm(dim=-1))
        assert st.tau.tolist() == s.plan.tau[layer, order[:3]].tolist()


def test_at_batch_1_the_persistent_heads_are_a_copy_not_a_view_that_holds_the_staged_kv(tmp_path):
    """At batch 1 the persistent heads' slice of the staged K/V is contiguous: a view of it would keep every
    layer's whole staged K/V alive through decode."""
    s = clo(tmp_path, batch=1)
    k0, v0 = prompt_kv()
    for layer in range(L):
        s.prefill(layer, k0[layer][:1], v0[layer][:1])
    s.end_prefill(T0)
    for st in s.stores[1:]:
        assert st.persist.untyped_storage().nbytes() == st.persist.numel() * st.persist.element_size()


def test_hash_index_in_chunks_equals_one_encoding():
    from kvoffload.offload.retrieval import HashRetriever

    r = HashRetriever(1, HKV, D, CPU, rbit=64)
    keys = torch.randn(B, HKV, 50, 2, D)[:, :, :, 0]  # a strided view, as CLO hands it
    r.index(0, keys, rows=7 * B * HKV)  # 7 tokens at a time
    assert torch.equal(r.codes[0], r.encode(0, keys.contiguous()))
    assert torch.equal(r.norms[0], keys.norm(dim=-1))


def tiny_model():
    cfg = tiny_config(num_layers=L, num_heads=H, num_kv_heads=HKV, head_dim=D)
    model = synthetic_decoder(cfg, 0, CPU, torch.float32)
    model.prefill_chunk = 64  # the decoder's chunks reuse memory while the offload is deferred
    return model


def test_a_deferred_offload_leaves_the_stores_the_synchronous_path_makes(tmp_path):
    model = tiny_model()
    tokens = torch.randint(0, 100, (B, T0), generator=torch.Generator().manual_seed(3))
    systems = []
    for deferred in (False, True):
        s = clo(tmp_path)
        if deferred:
            s.offload = DeferredOffload()
            for h in s.hosts:  # what a store read before its copy would hold
                if h is not None:
                    h.fill_(float("nan"))
        model.prefill(tokens, s)
        systems.append(s)
    sync, late = systems
    assert late.offload.deferred == L - 1 and late.offload.waiting is None  # end_prefill ran the last one
    for layer in range(1, L):
        a, b = sync.stores[layer], late.stores[layer]
        for name in ("host", "persist", "tau", "weights"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        prompt_rows = a.sink + a.recent  # the window's other rows are room for generated tokens
        assert torch.equal(a.window[:, :, :prompt_rows], b.window[:, :, :prompt_rows])
        assert torch.equal(sync.retriever.codes[layer], late.retriever.codes[layer])
        assert torch.equal(sync.retriever.norms[layer], late.retriever.norms[layer])
