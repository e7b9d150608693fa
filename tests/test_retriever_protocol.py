"""Every retriever a system may hold keeps kvoffload.offload.retrieval.Retriever's contract: index a layer's keys,
score them against a query ([B, h, T / pool], the pooled scores the block maxima of the unpooled ones), report its
index's bytes. A new retriever added to make_retriever or RetroInfer-style is checked here too."""

import inspect

import pytest
import torch

from baselines.wave_index import WaveRetriever
from kvoffload.offload.retrieval import RETRIEVERS, Retriever, make_retriever

B, HKV, G, T, D, POOL = 1, 2, 3, 48, 16, 8


def retrievers():
    cpu = torch.device("cpu")
    yield from (make_retriever(kind, 1, HKV, D, cpu, rbit=32, seed=0) for kind in RETRIEVERS)
    yield WaveRetriever(1, cluster_size=4, segment=T, iters=2, estimate=0.0)


@pytest.mark.parametrize("retriever", list(retrievers()), ids=lambda r: r.name)
def test_each_retriever_keeps_the_protocol(retriever):
    assert isinstance(retriever, Retriever)
    want = list(inspect.signature(Retriever.scores).parameters)[1:]  # without self
    assert list(inspect.signature(retriever.scores).parameters)[: len(want)] == want
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(B, HKV, T, D, generator=gen)
    retriever.index(0, keys)
    q, heads = torch.randn(B, HKV * G, D, generator=gen), torch.arange(HKV)
    every = retriever.scores(0, q, heads)
    pooled = retriever.scores(0, q, heads, pool=POOL)
    assert every.shape == (B, HKV, T) and every.dtype == torch.float32
    assert torch.equal(pooled, every.unflatten(-1, (T // POOL, POOL)).amax(-1))
    assert retriever.metadata_bytes() > 0
