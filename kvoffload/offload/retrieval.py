"""Top-k retrieval over the offloaded middle of the prompt (docs/systems.md, "Retrieval").

HashRetriever (HATA): keys and queries become sign bits of x @ W (W: head_dim x rbit per layer and KV head);
score(k) = sum over the query group of (1 - 2 * hamming(q_j, k) / rbit) * |k|. Codes and key norms are made
once at prefill and stay on the device. W is a seeded random projection (SimHash) unless learned weights are
given (`load_hash_weights`: a file of experiments.producers.train_hata): the record says which. ExactRetriever scores
sum_j q_j . k: the oracle for tests and ablations. PQRetriever (PQCache's product quantisation) is in pq_index.py.
Each returns absolute token indices [B, Hkv, k] of the candidates [lo, hi)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from kvoffload.errors import ConfigError
from kvoffload.kernels.hash_score import block_max, pack_signs
from kvoffload.kernels.radix_keys import count_first_pass_ref
from kvoffload.offload import pq_index
from kvoffload.paths import repo_path

RETRIEVERS = ("hash", "exact", "pq")
TOPK_METHODS = ("radix", "torch")  # select_topk's: the radix select on CUDA | torch.topk everywhere


@runtime_checkable
class Retriever(Protocol):
    """What a system asks of its retriever (ExactRetriever, HashRetriever, pq_index.PQRetriever and RetroInfer-style's
    baselines.wave_index.WaveRetriever): build an index of a layer's candidate keys at prefill, then score them
    against each step's query. The system selects the top-k of the scores (select_topk) and moves those rows."""

    name: str  # the record's `retriever`

    def index(self, layer: int, keys: torch.Tensor) -> None:
        """keys [B, Hkv, T, D] (a strided view will do): the layer's candidates, indexed on the device."""

    def scores(
        self,
        layer: int,
        q: torch.Tensor,
        heads: torch.Tensor,
        miss: torch.Tensor | None = None,
        hist: torch.Tensor | None = None,
        pool: int = 1,
    ) -> torch.Tensor:
        """q [B, H, D], heads [h] (the KV heads to score) -> [B, h, T / pool] float32, higher is better. miss [B, h]:
        the heads that need retrieval this step (a retriever may skip the others' rows); hist: the radix select's
        scratch (topk_work), whose first pass a retriever counts while it writes the scores; pool: the max over
        each block of `pool` positions (block-granular selection)."""

    def metadata_bytes(self) -> int:
        """Device bytes of the index (the systems' memory accounting)."""


def simhash_weights(num_layers: int, num_kv_heads: int, head_dim: int, rbit: int, seed: int) -> torch.Tensor:
    """The random projection (SimHash) HashRetriever uses without learned weights: [L, Hkv, D, rbit]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_layers, num_kv_heads, head_dim, rbit, generator=gen)


def save_hash_weights(path: Path, weights: torch.Tensor, meta: dict[str, str]) -> None:
    """Learned W [L, Hkv, D, rbit] as safetensors (no pickle), written to a temporary file then renamed."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({"weights": weights.contiguous()}, str(tmp), metadata=meta)
    tmp.replace(path)


def check_hash_weights(source: str | None, retriever: str) -> None:
    """A system's `hash_weights` setting, checked when the system is made (before the model is loaded): the file
    exists. Only the hash retriever reads it (another retriever ignores the model's default). The shapes are checked
    once the model's are known."""
    if source is None or retriever != "hash":
        return
    if not repo_path(source).is_file():
        raise ConfigError(
            f"hash_weights={source!r}: no such file (make one with `python -m experiments.producers.train_hata`)"
        )


def load_hash_weights(
    source: str, num_layers: int, num_kv_heads: int, head_dim: int, rbit: int | None
) -> tuple[torch.Tensor, str]:
    """W [L, Hkv, D, rbit] fp32 from a safetensors file of experiments.producers.train_hata (relative paths: from the
    repository root), checked against the model's shapes and the retriever's rbit (None: any); and a description
    for the record."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = repo_path(source)
    if not path.is_file():
        raise ConfigError(
            f"hash_weights={source!r}: no such file (make one with `python -m experiments.producers.train_hata`)"
        )
    try:
        w = load_file(str(path))["weights"]
    except (SafetensorError, KeyError, OSError) as e:
        raise ConfigError(f"hash_weights={source!r}: not a safetensors file with a 'weights' tensor ({e})") from None
    want = (num_layers, num_kv_heads, head_dim)
    if w.dim() != 4 or tuple(w.shape[:3]) != want:
        raise ConfigError(
            f"hash_weights {path.name} has shape {tuple(w.shape)}, the model needs {want} + (rbit,) "
            "(layers, kv heads, head_dim, rbit): weights of another model"
        )
    if rbit is not None and w.shape[3] != rbit:
        raise ConfigError(
            f"hash_weights {path.name} has rbit {w.shape[3]}, the system's rbit is {rbit}: set rbit={w.shape[3]}, "
            f"or hash_weights=<a file of rbit {rbit}> or null (SimHash)"
        )
    return w.float(), f"learned ({path.name})"


class ExactRetriever:
    name = "exact"
    weights_source = "exact top-k oracle"

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, device: torch.device):
        self.keys: list[torch.Tensor | None] = [None] * num_layers

    def index(self, layer: int, keys: torch.Tensor) -> None:
        """keys [B, Hkv, T, D] (a strided view will do): the candidates of this layer, kept on the device as a copy
        (a view would keep alive all of the prompt's tensor it was taken from)."""
        self.keys[layer] = keys.clone(memory_format=torch.contiguous_format)

    def scores(
        self,
        layer: int,
        q: torch.Tensor,
        heads: torch.Tensor,
        miss: torch.Tensor | None = None,
        hist: torch.Tensor | None = None,
        pool: int = 1,
    ):
        """q [B, H, D], heads [h] (KV heads to score) -> [B, h, T] float32. miss, hist, pool: HashRetriever's
        (every row is scored here; the radix select's first pass is counted in torch)."""
        keys = self.keys[layer][:, heads]
        b, hkv, t, d = self.keys[layer].shape
        qg = q.view(b, hkv, -1, d)[:, heads].float()
        return count_first_pass_ref(block_max(torch.einsum("bkgd,bktd->bkt", qg, keys.float()), pool), hist)

    def metadata_bytes(self) -> int:
        return sum(k.nbytes for k in self.keys if k is not None)  # the oracle keeps every candidate key


# HashRetriever.index encodes this many (sequence, head, token) rows at a time: ~3 KB of temporaries each at rbit
# 256 and D 128, ~50 MB in all (within experiments.runner.preflight.WORKSPACE_BYTES)
INDEX_ROWS = 16384


class HashRetriever:
    name = "hash"

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        rbit: int = 256,
        seed: int = 0,
        weights: torch.Tensor | None = None,
        weights_source: str = "learned",
    ):
        if rbit % 8 or rbit <= 0:
            raise ConfigError(f"rbit={rbit} must be a positive multiple of 8")
        self.rbit = rbit
        if weights is None:
            weights = simhash_weights(num_layers, num_kv_heads, head_dim, rbit, seed)
            self.weights_source = f"random projection (SimHash, seed {seed})"
        else:
            if tuple(weights.shape) != (num_layers, num_kv_heads, head_dim, rbit):
                raise ConfigError(
                    f"hash weights of shape {tuple(weights.shape)}; the retriever needs "
                    f"{(num_layers, num_kv_heads, head_dim, rbit)} (layers, kv heads, head_dim, rbit)"
                )
            self.weights_source = weights_source
        self.proj = weights.to(device)
        self.codes: list[torch.Tensor | None] = [None] * num_layers
        self.norms: list[torch.Tensor | None] = [None] * num_layers

    def encode(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x [B, Hkv, N, D] -> codes [B, Hkv, N, rbit / 8]."""
        return pack_signs(torch.einsum("bknd,kdr->bknr", x.float(), self.proj[layer]))

    def index(self, layer: int, keys: torch.Tensor, rows: int = INDEX_ROWS) -> None:
        """keys [B, Hkv, T, D] (a strided view will do) -> their codes and norms, encoded `rows` (sequence, head,
        token) rows at a time: a whole layer's fp32 projections at once are 8x its bf16 keys at rbit 256 and D 128
        (1 GB at 128K tokens)."""
        b, hkv, t, _ = keys.shape
        codes = torch.empty(b, hkv, t, self.rbit // 8, dtype=torch.uint8, device=keys.device)
        norms = torch.empty(b, hkv, t, dtype=torch.float32, device=keys.device)
        chunk = max(1, rows // (b * hkv))
        for s in range(0, t, chunk):
            part = keys[:, :, s : s + chunk]
            codes[:, :, s : s + chunk] = self.encode(layer, part)
            norms[:, :, s : s + chunk] = part.float().norm(dim=-1)
        self.codes[layer], self.norms[layer] = codes, norms

    def encode_query(self, layer: int, q: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """q [B, H, D] -> codes of each scored KV head's query group [B, h, G, rbit / 8]."""
        from kvoffload.kernels.hash_score import encode_query_triton, triton

        b, hkv = self.codes[layer].shape[:2]
        d = q.shape[-1]
        if q.is_cuda and triton is not None and self.rbit % 32 == 0 and d & (d - 1) == 0:
            return encode_query_triton(
                q if q.stride(2) == 1 else q.contiguous(), self.proj[layer], heads, q.shape[1] // hkv
            )
        return self.encode(layer, q.view(b, hkv, -1, d))[:, heads]

    def scores(
        self,
        layer: int,
        q: torch.Tensor,
        heads: torch.Tensor,
        miss: torch.Tensor | None = None,
        hist: torch.Tensor | None = None,
        pool: int = 1,
    ):
        """miss [B, nc]: on CUDA the first nc heads are scored only where they missed (a hit reuses its cached
        rows), their other rows left unset. hist: topk_work's; the scores' kernel also counts the radix select's
        first pass into it. pool > 1: each block of `pool` tokens scored by its best token, [B, h, ceil(T /
        pool)] (block_max), in the same launch on CUDA."""
        from kvoffload.kernels.hash_score import hash_scores  # Triton on CUDA, the torch reference elsewhere

        qc = self.encode_query(layer, q, heads)
        return hash_scores(self.codes[layer], self.norms[layer], qc, self.rbit, heads, miss, hist, pool)

    def metadata_bytes(self) -> int:
        return sum(c.nbytes + n.nbytes for c, n in zip(self.codes, self.norms) if c is not None)


def metadata_bytes_per_head(kind: str, rbit: int, head_dim: int, dtype_bytes: int, tokens: int) -> int:
    """Device bytes a retriever keeps for one sequence's KV head of `tokens` candidates (what metadata_bytes()
    counts once allocated): the hash codes and key norms, PQ's codes and its sub-spaces' centroids, or the oracle's
    keys."""
    if kind == "hash":
        return tokens * (rbit // 8 + 4)
    if kind == "pq":
        return tokens * pq_index.SUBVECTORS + min(1 << pq_index.BITS, tokens) * head_dim * 4
    return tokens * head_dim * dtype_bytes


def make_retriever(
    kind: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    rbit: int,
    seed: int,
    hash_weights: str | None = None,
) -> Retriever:
    """hash_weights: a learned W's file (load_hash_weights) for the hash retriever; None: SimHash with `seed`."""
    if kind == "hash":
        if hash_weights is None:
            return HashRetriever(num_layers, num_kv_heads, head_dim, device, rbit, seed)
        w, source = load_hash_weights(hash_weights, num_layers, num_kv_heads, head_dim, rbit)
        return HashRetriever(num_layers, num_kv_heads, head_dim, device, rbit, seed, w, source)
    if kind == "exact":
        return ExactRetriever(num_layers, num_kv_heads, head_dim, device)
    if kind == "pq":
        return pq_index.PQRetriever(num_layers, num_kv_heads, head_dim, device, seed=seed)
    raise ConfigError(f"retriever={kind!r}; valid: {', '.join(RETRIEVERS)}")


def topk_work(method: str, rows: int, device: torch.device) -> torch.Tensor | None:
    """Where select_topk(method=) runs the radix select: its scratch, for the retriever's scores(hist=) to count
    the select's first pass into while it writes the scores (one pass over them fewer); None elsewhere."""
    from kvoffload.kernels.radix_keys import radix_work
    from kvoffload.kernels.radix_topk import radix_runs

    return radix_work(rows, device) if method == "radix" and radix_runs(device) else None


def check_topk_method(method: str) -> None:
    if method not in TOPK_METHODS:
        raise ConfigError(f"topk={method!r}; valid: {', '.join(TOPK_METHODS)}")


def select_topk(
    scores: torch.Tensor,
    k: int,
    offset: int,
    ascending: bool = True,
    method: str = "radix",
    miss: torch.Tensor | None = None,
    work: torch.Tensor | None = None,
) -> torch.Tensor:
    """scores [B, Hkv, T] over candidates starting at token `offset` -> absolute indices [B, Hkv, k], ascending
    unless `ascending=False`: attention and the gathers do not need the order, and at 128K sorting the
    indices costs more than the top-k itself, torch.topk's or the radix select's of kvoffload/kernels/radix_topk.py
    that CUDA uses (the sort and the top-k: results/LEDGER.md, results/bench/README.md). The
    radix select writes them ascending itself (its ordered last pass: one kernel more, no sort).
    torch.topk elsewhere, or everywhere with method="torch" (one launch instead of six: possibly cheaper where the
    step is launched eagerly). miss [B, nc]: the radix select's rows of the first nc heads that hit are left unset
    (HashRetriever.scores). work: topk_work's, its first pass counted by the retriever's scores(hist=)."""
    from kvoffload.kernels.radix_topk import topk_indices, topk_ref

    if method == "radix":  # ascending from the select itself, with no sort (radix_topk's ordered pass)
        return topk_indices(scores, k, offset, miss, work, ordered=ascending)
    idx = topk_ref(scores, k, offset)
    return idx.sort(dim=-1).values if ascending else idx
