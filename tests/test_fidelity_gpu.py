"""The fidelity measure on the GPU path: each system's CUDA decode gives the fidelity its CPU reference gives on the
same weights and documents, so that the GPU throughput records and the CPU fidelity records describe one algorithm.
Synthetic weights at SmolLM2's shape (no checkpoint travels to the GPU machine), drawn once on the CPU and copied to
the device; documents of seeded token ids that repeat, so that attention has something to find."""

import pytest
import torch

from experiments.accuracy.backbone import Backbone
from experiments.accuracy.config import compose_config
from experiments.fidelity.documents import Document
from experiments.fidelity.measure import reference, teacher_forced

LENGTH, STEPS, DOCS = 2048, 32, 2
SYSTEMS = ["fullattn", "clo", "retroinfer", "infinigen", "pqcache", "clo +clo_ablation=oracle"]


def backbone(device: str, dtype: str) -> Backbone:
    cfg, _ = compose_config(["workload=fidelity", "model.weights=synthetic", f"device={device}", f"dtype={dtype}"])
    return Backbone(cfg, real_weights=False)


@pytest.fixture(scope="module")
def pair():
    cpu = backbone("cpu", "float32")
    gpu = backbone("cuda", "bfloat16")
    gpu.model.load_state_dict({k: v.to("cuda", torch.bfloat16) for k, v in cpu.model.state_dict().items()})
    gen = torch.Generator().manual_seed(0)
    docs = []
    for i in range(DOCS):  # a phrase of 64 tokens repeated with noise: earlier copies are worth attending
        phrase = torch.randint(0, 49152, (64,), generator=gen)
        ids = phrase.repeat(LENGTH // 64)
        noise = torch.rand(LENGTH, generator=gen) < 0.2
        ids[noise] = torch.randint(0, 49152, (int(noise.sum()),), generator=gen)
        docs.append(Document(f"doc{i}", tuple(ids.tolist()), ""))
    refs = {b: [reference(b, d, STEPS) for d in docs] for b in (cpu, gpu)}
    return cpu, gpu, docs, refs


def fidelity(b: Backbone, name: str, docs, refs):
    cfg, system_name = compose_config(["workload=fidelity", "model.weights=synthetic", *f"system={name}".split(" ")])
    prefix = LENGTH - STEPS - 1
    system = b.system(cfg.system, system_name, prefix, STEPS, len(docs), b.layer_time_s * len(docs))
    return teacher_forced(b, system, docs, refs)[0]


@pytest.mark.gpu
@pytest.mark.parametrize("name", SYSTEMS)
def test_the_cuda_path_gives_the_fidelity_of_the_cpu_reference(pair, name):
    """The two devices' exact references differ by bf16 against fp32 alone; a system's fidelity on each device
    (its distance from that device's exact attention) may differ by that and by the selections the rounding flips
    near a tie: each document's KL and top-1 agreement agree within a margin of the references' own difference."""
    cpu, gpu, docs, refs = pair
    floor = max(
        float((r.logp.exp() * (r.logp - g.logp.float().cpu())).sum(-1).mean()) for r, g in zip(refs[cpu], refs[gpu])
    )
    on_cpu = fidelity(cpu, name, docs, refs[cpu])
    on_gpu = fidelity(gpu, name, docs, refs[gpu])
    for c, g in zip(on_cpu, on_gpu):
        assert abs(c["kl"] - g["kl"]) <= 0.25 * max(c["kl"], g["kl"]) + 10 * floor, (name, c, g, floor)
        assert abs(c["top1"] - g["top1"]) <= 2 / STEPS + 0.1 * (1 - min(c["top1"], g["top1"])), (name, c, g)
