"""How far a system's next-token distributions are from exact attention's, token by token, on the same context.

A document of L tokens is split into a prefix of T0 = L - N - 1 tokens, prefilled (densely, whatever the system),
and N teacher-forced decode steps: step i feeds the document's token T0 + i and predicts token T0 + i + 1, so every
system sees the same context at every step whatever it predicted. The reference at step i is one dense forward pass
over the whole document (the model with exact attention), read at position T0 + i; FullAttn run through the same
decode steps must match it (tests/test_fidelity.py), which checks the harness itself."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from experiments.accuracy.backbone import Backbone, Prefill, PrefillRecorder
from experiments.fidelity.documents import Document
from experiments.fidelity.selection import SelectionProbe
from kvoffload.generate import sync_device
from kvoffload.kv.interface import KVOffloadSystem

METRICS = ("kl", "top1", "ll", "ll_ref")


@dataclass
class Reference:
    """A document's prefix prefill (its K/V are what every system is handed) and exact attention's log-probs
    [N, V] at the N decode steps."""

    prefill: Prefill
    logp: torch.Tensor

    @property
    def nbytes(self) -> int:  # what a PrefillCache holds for it
        return self.prefill.nbytes + self.logp.numel() * self.logp.element_size()


def prefix_tokens(length: int, steps: int) -> int:
    return length - steps - 1


def reference(backbone: Backbone, doc: Document, steps: int) -> Reference:
    """One dense forward over the whole document: the prefix's K/V and the log-probs at the scored positions."""
    t0 = prefix_tokens(len(doc.ids), steps)
    rec = PrefillRecorder()
    tokens = torch.tensor([doc.ids], dtype=torch.long, device=backbone.device)
    sync_device(backbone.device)
    start = time.perf_counter()
    logits = backbone.model.prefill(tokens, rec, all_logits=True)[0]
    logp = torch.log_softmax(logits[t0 : t0 + steps].float(), dim=-1)
    last = logits[t0 - 1 : t0].clone()  # the prefix's own last logits, as its prefill gives them
    k = [x[:, :, :t0].contiguous() for x in rec.k]  # causal: the prefix's K/V, as a prefill of it alone makes
    v = [x[:, :, :t0].contiguous() for x in rec.v]
    del logits, rec
    sync_device(backbone.device)
    return Reference(Prefill(last, k, v, time.perf_counter() - start), logp)


def batched(refs: list[Reference]) -> Prefill:
    """The documents' prefix prefills as one batch (one prefix length: every document has the same)."""
    k = [torch.cat(layer) for layer in zip(*(r.prefill.k for r in refs))]
    v = [torch.cat(layer) for layer in zip(*(r.prefill.v for r in refs))]
    logits = torch.cat([r.prefill.logits for r in refs])
    return Prefill(logits, k, v, sum(r.prefill.seconds for r in refs))


def step_metrics(logp: torch.Tensor, ref: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[..., 4]: kl, top1, ll, ll_ref of steps: logp, ref [..., V] log-probs, target [...] the true next tokens."""
    kl = (ref.exp() * (ref - logp)).sum(-1)
    top1 = (logp.argmax(-1) == ref.argmax(-1)).float()
    ll = logp.gather(-1, target[..., None])[..., 0]
    ll_ref = ref.gather(-1, target[..., None])[..., 0]
    return torch.stack([kl, top1, ll, ll_ref], dim=-1)


def teacher_forced(
    backbone: Backbone,
    system: KVOffloadSystem,
    docs: list[Document],
    refs: list[Reference],
    window: tuple[int, int] | None = None,
) -> tuple[list[dict], dict]:
    """The system's decode steps over the documents' last N tokens after their prefixes, the documents decoded as
    one batch (a system treats its sequences independently: tests/test_fidelity.py checks that a batch gives each
    document what it gets alone), scored against refs. window: the system's (sink, recent), to measure what its
    sparse layers attended (SelectionProbe); None: not measured. Returns (per document {doc, kl, top1, ll, ll_ref,
    and recall and mass over the sparse layers where measured}, the batch's cost: hit rate, host->device bytes per
    sequence and step, ms per step, and per sparse layer the batch's mean recall and mass)."""
    steps = refs[0].logp.shape[0]
    t0 = prefix_tokens(len(docs[0].ids), steps)
    ids = torch.tensor([d.ids for d in docs], dtype=torch.long, device=backbone.device)  # [B, L]
    ref = torch.stack([r.logp for r in refs], dim=1)  # [N, B, V]
    prefill = batched(refs)
    probe = None if window is None else SelectionProbe(system, prefill.k, *window)
    prefill.load_into(system)
    rows, stats, seconds = [], [], 0.0
    for i in range(steps):
        sync_device(backbone.device)
        start = time.perf_counter()
        system.begin_step()
        logits = backbone.model.decode(ids[:, t0 + i], system.position, system)  # [B, V]
        stats.append(system.end_step())
        sync_device(backbone.device)
        seconds += time.perf_counter() - start  # the decode step alone, not what is measured of it
        rows.append(step_metrics(torch.log_softmax(logits.float(), dim=-1), ref[i], ids[:, t0 + i + 1]))
        if probe is not None:
            probe.after_step()
    means = torch.stack(rows).double().mean(0).tolist()  # [B, 4]
    per_doc = [{"doc": d.name, **dict(zip(METRICS, m))} for d, m in zip(docs, means)]
    lookups = sum(s.lookups for s in stats)
    cost = {
        "docs": len(docs),
        "lookups": lookups,
        "hits": sum(s.hits for s in stats),
        "bytes_h2d_per_step": sum(s.bytes_h2d for s in stats) / steps / len(docs),
        "decode_ms_per_step": seconds * 1e3 / steps,
    }
    layers = probe.per_layer() if probe is not None else {}
    if layers:
        by_doc = torch.stack(list(layers.values())).double().mean(0).tolist()  # [B, 2] over the sparse layers
        for d, (recall, mass) in zip(per_doc, by_doc):
            d["recall"], d["mass"] = recall, mass
        cost["per_layer"] = {str(layer): v.double().mean(0).tolist() for layer, v in layers.items()}
    return per_doc, cost
