"""InfiniGen-style baseline (docs/systems.md, "InfiniGen-style"; snu-comparch/InfiniGen, and the re-implementation the
CLO authors used in gpzlx1/HATA kvcache_infinigen.py): no cache; during layer l-1 the important tokens of layer l are
speculated from partial query/key channels and prefetched from host memory every step.

Speculation. InfiniGen skews each head's query/key space with an orthogonal matrix from an SVD (so that q.k is
unchanged and a few channels carry most of it), keeps a "partial key" = the keys on `channel_fraction` of the
skewed channels, and scores the speculative query (layer l's query from layer l-1's input) on those channels.
InfiniGen computes the skewing matrix offline from a real model's activations: `skew=<file>` loads ours
(`python -m experiments.producers.infinigen_skew`: right singular vectors of real queries per KV head; SmolLM2's is
committed). The fallback for models without one (synthetic weights) computes it at prefill from each sequence's
own prompt keys, per KV head: the right singular vectors of the middle keys (eigenvectors of K^T K), the top
`channel_fraction` of them by singular value. Scores are summed over
the query group (GQA), as HATA's re-implementation; the budget is CLO's (same top-k as every system) instead of
InfiniGen's alpha threshold.

Per sparse layer l of a step:
  prepare(l, q_spec)  retrieval         partial scores (one batched matmul in the model's dtype) and top-k on
                                        the device, during layer l-1
                      (overlapped)      on CUDA with transfer=cpu_gather: a worker thread waits for the indices
                                        (the CPU-centric sync), gathers the rows (gather_threads) and copies them
                                        to a device buffer chunk by chunk while the device runs layer l-1
                                        (baselines/cpu_fetch.py); transfer=uva: the GPU gathers them itself on a
                                        copy stream; on a CPU run the gather is done here
  decode(l)           transfer_exposed  what layer l still waits for of that fetch
                      attention         window + the fetched rows
With `graphs` (auto: on CUDA with the worker's fetch) the speculation and the attention are replayed from
per-layer CUDA graphs, the attention in the split kernel over the window and the fetched rows where they lie
(baselines/infinigen_graphs.py); without, they run eagerly and the attention concatenates the two first.
With `oracle_query` the real query and exact q.k scores replace the speculation (the test's oracle); decode then
does the whole fetch itself.
"""

from __future__ import annotations

import torch

from baselines.cpu_fetch import CHUNK_ROWS, PipelinedFetcher, gather_threads
from baselines.infinigen_graphs import InfiniGenLayerGraphs
from baselines.offloaded import GRAPH_MODES, OffloadedBaseline, sized
from kvoffload.errors import ConfigError
from kvoffload.kv.interface import KVSpec, StepStats
from kvoffload.offload.budget import split_prompt
from kvoffload.offload.retrieval import ExactRetriever, select_topk
from kvoffload.paths import repo_path

PREFILL_CHUNK_BYTES = 64 << 20  # the fp32 keys of one chunk of the prefill's partial-key work


class InfiniGen(OffloadedBaseline):
    name = "infinigen"

    def __init__(
        self,
        topk_ratio: float = 0.1,
        sink: int = 16,
        recent: int = 64,
        dense_layers: int = 2,
        channel_fraction: float = 0.3,
        oracle_query: bool = False,
        transfer: str = "cpu_gather",
        cpu_threads: int | str = "auto",
        skew: str = "prefill",
        topk: str = "radix",
        fetch_chunk_rows: int = CHUNK_ROWS,
        graphs: str = "auto",
    ) -> None:
        super().__init__(topk_ratio, sink, recent, dense_layers, transfer, cpu_threads, topk=topk)
        self.auto_threads = cpu_threads == "auto"  # the gather's count then follows its size (gather_threads)
        if not 0.0 < channel_fraction <= 1.0:
            raise ConfigError(f"channel_fraction={channel_fraction} must lie in (0, 1]")
        if fetch_chunk_rows < 1:
            raise ConfigError(f"fetch_chunk_rows={fetch_chunk_rows} must be at least 1")
        self.fetch_chunk_rows = fetch_chunk_rows
        if graphs not in GRAPH_MODES:
            raise ConfigError(f"graphs={graphs!r}; valid: {', '.join(GRAPH_MODES)}")
        self.graphs = graphs
        self.channel_fraction, self.oracle_query, self.skew = channel_fraction, oracle_query, skew
        self.wants_speculative_query = not oracle_query

    def channels(self, head_dim: int) -> int:
        return max(1, round(self.channel_fraction * head_dim))

    def estimate_parts(self, spec: KVSpec) -> dict[str, int]:
        t0 = spec.prompt_tokens
        n_mid = split_prompt(t0, self.sink, self.recent)[2]
        heads = spec.batch * spec.num_kv_heads
        sparse = spec.num_layers - min(self.dense_layers, spec.num_layers)
        r, d = self.channels(spec.head_dim), spec.head_dim
        # metadata = what scoring reads: partial keys + skew basis, or the oracle's full candidate keys
        if self.oracle_query:  # the exact scorer keeps every candidate key on the device
            partial = sparse * heads * n_mid * d * spec.dtype_bytes
        else:  # partial keys + the skew basis
            partial = sparse * heads * (n_mid * r * spec.dtype_bytes + d * r * 4) if n_mid else 0
        buffers = 2 * heads * self.k_select(t0) * spec.host_row_bytes if sparse else 0
        staging = 0
        if self.pipelined(spec) and buffers:  # pinned: two parities of staged rows + their indices
            staging = buffers + 2 * heads * self.k_select(t0) * 8
        return {
            **self.common_estimate(spec),
            "metadata": partial,
            "fetch_buffers": buffers,
            "host_staging": staging,
        }

    def pipelined(self, spec: KVSpec) -> bool:
        """The worker-thread fetch (cpu_fetch.py): CUDA, cpu_gather, a speculative query to fetch ahead with."""
        return spec.device.type == "cuda" and self.transfer_kind == "cpu_gather" and not self.oracle_query

    def _allocate(self, spec: KVSpec) -> None:
        super()._allocate(spec)
        L = spec.num_layers
        self.basis: list[torch.Tensor | None] = [None] * L  # [B, Hkv, D, r] fp32: the skewed partial channels
        self.partial: list[torch.Tensor | None] = [None] * L  # [B, Hkv, n_mid, r]: the partial key cache
        self.exact = ExactRetriever(L, spec.num_kv_heads, spec.head_dim, spec.device)  # oracle_query only
        self.buffers: list[torch.Tensor] = []  # two device buffers, alternating by layer (fetch l+1, attend l)
        # layer -> (buffer, copy done, the indices the copy stream reads: held until the copy is waited for, so the
        # compute stream cannot reuse their memory while a uva gather still reads them)
        self.pending: dict[int, tuple[torch.Tensor, torch.cuda.Event | None, torch.Tensor]] = {}
        cuda = spec.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(spec.device) if cuda else None
        self.fill_heads = self.heads.cpu() if self.transfer_kind == "cpu_gather" else self.heads
        self.fill_miss = torch.ones(spec.batch, spec.num_kv_heads, dtype=torch.bool, device=self.fill_heads.device)
        self.offline = self._load_skew(spec)
        self.fetcher: PipelinedFetcher | None = None  # made with the buffers, at prefill
        self.gather_gb_s = 0.0  # the CPU gather alone, the floor's host rate: the best of gather_alone
        self.gather_alone: dict[int, float] = {}  # GB/s by thread count, the last indices over every layer's store
        self.gathered_ms, self.gathered_bytes = 0.0, 0  # the decode steps' gathers
        if self.graphs == "on" and not self.pipelined(spec):
            raise ConfigError(
                "graphs=on needs a CUDA device, transfer=cpu_gather and oracle_query=false; use graphs=auto or off"
            )
        self.use_graphs = self.graphs != "off" and self.pipelined(spec)
        self.layer_graphs: dict[int, InfiniGenLayerGraphs] = {}
        self.graph_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    def _load_skew(self, spec: KVSpec) -> torch.Tensor | None:
        """The offline skew bases ([L, Hkv, D, D], by `python -m experiments.producers.infinigen_skew`), or None
        (prefill)."""
        if self.skew == "prefill" or self.oracle_query:
            return None
        path = repo_path(self.skew)
        if not path.is_file():
            raise ConfigError(
                f"skew={self.skew!r}: no such file (make it with python -m experiments.producers.infinigen_skew, "
                f"or use skew=prefill)"
            )
        bases = torch.load(path)
        want = (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.head_dim)
        if tuple(bases.shape) != want:
            raise ConfigError(f"skew file {path.name} has shape {tuple(bases.shape)}, the model needs {want}")
        return bases[..., : self.channels(spec.head_dim)].float().to(spec.device)

    def prefill_sparse(self, layer: int, keys_mid: torch.Tensor, n_mid: int, rows: torch.Tensor) -> None:
        spec = self.spec
        k_sel = self.k_select(self.t0)
        if k_sel and not self.buffers:
            shape = (spec.batch, spec.num_kv_heads, k_sel, 2, spec.host_width)  # host rows, as the store holds them
            self.buffers = [torch.zeros(shape, dtype=spec.host_dtype, device=spec.device) for _ in range(2)]
            if self.pipelined(spec):
                rows = spec.batch * spec.num_kv_heads * k_sel
                if self.auto_threads:
                    self.cpu_threads = gather_threads(self.cpu_threads, rows * spec.host_row_bytes, spec.batch)
                self.fetcher = PipelinedFetcher(
                    rows,
                    2 * spec.host_width,
                    spec.host_dtype,
                    spec.device,
                    self.cpu_threads,
                    self.fetch_chunk_rows,
                    self.pacer,
                )
        if not n_mid:
            return
        if self.oracle_query:
            self.exact.index(layer, keys_mid)
            return
        # fp32 temporaries a chunk of tokens at a time: the whole batch's keys in fp32 at once would be 2x the
        # layer's bf16 keys beside the prefill, more than the memory plan holds for it
        b, hkv, n, d = keys_mid.shape
        step = max(1, PREFILL_CHUNK_BYTES // (b * hkv * d * 4))
        chunks = [(s, min(s + step, n)) for s in range(0, n, step)]
        if self.offline is not None:
            basis = self.offline[layer].expand(spec.batch, -1, -1, -1).contiguous()  # [B, Hkv, D, r]
        else:
            gram = sum(c.transpose(-1, -2) @ c for c in (keys_mid[:, :, a:e].float() for a, e in chunks))
            # on the host: torch's CUDA eigh solves a small matrix at a time, slower than the host's LAPACK for
            # these D x D matrices (experiments/bench/bench_skew_eigh.py); ascending eigenvalues = the keys' squared
            # singular values
            _, vecs = torch.linalg.eigh(gram.cpu())
            basis = vecs[..., -self.channels(d) :].flip(-1).to(spec.device).contiguous()  # [B, Hkv, D, r]
        self.basis[layer] = basis
        partial = keys_mid.new_empty(b, hkv, n, basis.shape[-1], dtype=spec.dtype)
        for a, e in chunks:
            partial[:, :, a:e] = (keys_mid[:, :, a:e].float() @ basis).to(spec.dtype)
        self.partial[layer] = partial

    def prepare(self, layer: int, q_spec: torch.Tensor) -> None:
        if layer >= self.dense_layers and self.window[layer] is not None and self.k_select(self.t0):
            if self.use_graphs:
                self.graphs_of(layer).speculate(q_spec)
            else:
                self.fetch(layer, q_spec)

    def graphs_of(self, layer: int) -> InfiniGenLayerGraphs:
        if layer not in self.layer_graphs:
            self.layer_graphs[layer] = InfiniGenLayerGraphs(self, layer, self.graph_pool)
        return self.layer_graphs[layer]

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not self.use_graphs or layer in self.dense or not self.k_select(self.t0):
            return super().decode(layer, q, k, v)
        n_win = self.append_window(layer, k, v)
        graphs = self.graphs_of(layer)
        if layer not in self.pending:  # no speculation for this layer (no layer before it): select with q now
            graphs.speculate(q)
        return graphs.attend(q, n_win)

    def partial_scores(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [B, H, D] -> [B, Hkv, n_mid]: the sum over the query group of q_j . k on the partial channels, i.e.
        (sum_j q_j) projected on the skew basis . the partial key."""
        b, hkv, d = self.spec.batch, self.spec.num_kv_heads, self.spec.head_dim
        qsum = q.view(b, hkv, -1, d).float().sum(2)
        pq = torch.einsum("bkd,bkdr->bkr", qsum, self.basis[layer]).to(self.spec.dtype)
        # one batched matmul over the partial keys as they are stored (fp32 accumulation in the GEMM), not a
        # per-layer fp32 copy of the whole partial key cache
        part = self.partial[layer]
        return torch.matmul(part.view(b * hkv, *part.shape[2:]), pq.view(b * hkv, -1, 1)).view(b, hkv, -1)

    def start_fetch(self, layer: int) -> None:
        """The worker's fetch of layer `layer`'s rows, whose flat indices the current stream is copying into the
        fetcher's index buffer of the layer's parity."""
        spec, buf, d = self.spec, self.buffers[layer % 2], self.spec.host_width
        host = self.host[layer].view(-1, 2 * d)
        self.pending[layer] = (buf, self.fetcher.submit(layer % 2, host, buf.view(-1, 2 * d)), None)
        rows = spec.batch * spec.num_kv_heads * self.k_select(self.t0)
        self.step.host_syncs += 1  # the worker waits for the indices
        self.step.bytes_d2h += rows * 8
        self.step.bytes_h2d += rows * spec.host_row_bytes

    def wait_fetch(self, layer: int) -> torch.Tensor:
        """The compute stream waits for the layer's fetch (the host waits for the worker to have issued it)."""
        buf, fetch, _ = self.pending.pop(layer)
        with self.phase("transfer_exposed"):
            self.fetcher.wait(fetch)
        return buf

    def fetch(self, layer: int, q: torch.Tensor) -> None:
        spec = self.spec
        b, hkv = spec.batch, spec.num_kv_heads
        k_sel = self.k_select(self.t0)
        with self.phase("retrieval"):
            if self.oracle_query:
                scores = self.exact.scores(layer, q, self.heads)
            else:
                scores = self.partial_scores(layer, q)
            idx = select_topk(scores, k_sel, 0, method=self.topk)  # [B, Hkv, k] positions among the middle tokens
        self.note_middle(layer, idx)
        if self.fetcher is not None:
            t = self.host[layer].shape[2]
            base = (torch.arange(b * hkv, device=idx.device) * t).view(b, hkv, 1)
            self.fetcher.idx[layer % 2].copy_((idx + base).view(-1), non_blocking=True)
            self.start_fetch(layer)
            return
        with self.phase("launch_sync"):
            idx_host = idx.cpu()  # a blocking copy: the CPU gather needs the indices
        self.step.host_syncs += 1
        self.step.bytes_d2h += idx_host.nbytes
        with self.phase("transfer_exposed"):
            buf = self.buffers[layer % 2]
            idx_fill = idx_host if self.fill_heads.device.type == "cpu" else idx
            event = None
            if self.copy_stream is not None:
                self.copy_stream.wait_stream(torch.cuda.current_stream())  # buf may still be read by attention
                with torch.cuda.stream(self.copy_stream):
                    self.transfer.fill(self.host[layer], self.fill_heads, idx_fill, self.fill_miss, buf)
                    event = torch.cuda.Event()
                    event.record(self.copy_stream)
            else:
                self.transfer.fill(self.host[layer], self.fill_heads, idx_fill, self.fill_miss, buf)
            self.transfer.host_syncs = 0  # counted above, where the indices came to the host
        self.step.bytes_h2d += b * hkv * k_sel * spec.host_row_bytes
        self.pending[layer] = (buf, event, idx_fill)

    def selected_rows(self, layer: int, q: torch.Tensor, k_sel: int) -> tuple[torch.Tensor, None]:
        if self.oracle_query or layer not in self.pending:  # no speculation for this layer: fetch now
            self.fetch(layer, q)
        if self.fetcher is not None:  # every fetch went to the worker (pipelined() excludes the oracle)
            return self.wait_fetch(layer), None
        buf, event, _ = self.pending.pop(layer)
        with self.phase("launch_sync"):
            if event is not None:
                event.synchronize()
        self.step.host_syncs += 1
        return buf, None  # every row a token

    def end_step(self) -> StepStats:
        if self.fetcher is not None:  # every fetch of the step has been waited for: its gathers are done
            if not self.gather_gb_s and self.fetcher.last_parity is not None:  # once, on the first step's own rows
                self.gather_alone = self.fetcher.calibrate(self.host_store_rows())
                self.gather_gb_s = max(self.gather_alone.values())
            ms, nbytes = self.fetcher.take_gathers()
            self.gathered_ms += ms
            self.gathered_bytes += nbytes
            # its floor's host part: the gathered bytes at the gather's own bandwidth, not the time this step's
            # gathers took (beside the copies and the decode step they can be slower: the gap is the baseline's)
            self.step.host_work_ms += nbytes / (self.gather_gb_s * 1e6) if self.gather_gb_s else ms
        return super().end_step()

    def memory_parts(self) -> dict[str, int]:
        partial = sized(self.partial) + sized(self.basis) + self.exact.metadata_bytes()
        return {
            **self.common_parts(),
            "metadata": partial,
            "fetch_buffers": sum(x.nbytes for x in self.buffers),
            "host_staging": self.fetcher.nbytes if self.fetcher is not None else 0,
        }

    def describe(self) -> dict:
        d = self.spec.head_dim
        skew = (
            "none: oracle_query uses the real query and exact q.k scores"
            if self.oracle_query
            else "prefill fallback: right singular vectors of each sequence's middle prompt keys per KV head "
            "(InfiniGen computes the skew offline from real activations)"
            if self.offline is None
            else f"offline: {self.skew} (right singular vectors of real query activations per KV head)"
        )
        return {
            "skew": skew,
            "channels": f"{self.channels(d)} of {d} ({self.channel_fraction:.0%})",
            "oracle_query": self.oracle_query,
            "transfer": self.transfer_kind,
            "fetch": "worker thread, chunked gather + copy overlapping layer l-1 (cpu_fetch.py)"
            if self.fetcher is not None
            else "in the launch thread",
            "cpu_threads": self.cpu_threads,
            "fetch_chunk_rows": self.fetch_chunk_rows,
            "graphs": "per-layer CUDA graphs: speculation; split attention over window + fetched rows"
            if self.use_graphs
            else "none: eager speculation, attention over the window and fetched rows concatenated",
            "cpu_gather_gb_s": {
                "alone": round(self.gather_gb_s, 2),  # what the floor's host part divides the gathered bytes by
                "alone_by_threads": {t: round(x, 2) for t, x in self.gather_alone.items()},
                "in_steps": round(self.gathered_bytes / self.gathered_ms / 1e6, 2) if self.gathered_ms else None,
            }
            if self.fetcher is not None
            else None,
            "topk": self.topk,
            "link_gb_s": self.link_gb_s,
            "memory_parts": self.memory_parts(),
        }
