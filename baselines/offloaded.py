"""What the offloading baselines share, in CLO's conventions, so that with the exact retriever every system
attends exactly the same top-k tokens (see OffloadedBaseline)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvoffload.errors import ConfigError
from kvoffload.kernels.decode_attention import attend_packed
from kvoffload.kernels.fp8_rows import dequantize_rows
from kvoffload.kv.interface import KVOffloadSystem, KVSpec
from kvoffload.offload.budget import check_budget, select_budget, split_prompt
from kvoffload.offload.host import Offload, host_stores, host_stores_pinned, layer_store
from kvoffload.offload.layers import DenseLayers, prompt_window, window_positions
from kvoffload.offload.link import link_pacer
from kvoffload.offload.retrieval import check_topk_method
from kvoffload.offload.transfer import TransferEngine
from kvoffload.offload.transfer import cpu_threads as resolve_threads

GRAPH_MODES = ("auto", "on", "off")  # a baseline's per-layer CUDA graphs: where it can, always, never


def sized(tensors) -> int:
    """Bytes of the tensors in a per-layer list (None where a layer holds none)."""
    return sum(t.nbytes for t in tensors if t is not None)


def replay_graph(graphs: dict, name: str, fn, pool) -> None:
    """Replays graphs[name], capturing fn() into it first (after one eager call: kernels compiled, library state
    made) into the memory pool `pool`. Capture errors are the capturing thread's only: a baseline's worker thread
    (InfiniGen-style's fetch) may sync with its own events meanwhile."""
    g = graphs.get(name)
    if g is None:
        fn()
        g = graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
            fn()
    g.replay()


class OffloadedBaseline(KVOffloadSystem):
    """CLO's conventions, shared by the baselines: the first `dense_layers` layers keep their full KV on the device
    and attend densely; in the others, sink + recent prompt tokens and every generated token stay in a device
    window, the middle of the prompt lives in host memory (pinned on CUDA), and each step attends the window plus
    k_select(prompt) middle rows per KV head, CLO's budget rule. A subclass supplies selected_rows() and
    memory_parts() / estimate_parts(spec): the same named parts from its buffers and from shapes. Under
    kv_dtype=fp8 the host stores and every device buffer their rows land in hold packed FP8 rows (spec.host_width
    wide, spec.host_dtype), quantised by the prefill's host copy; attention dequantises the selected rows
    (attend_packed)."""

    kv_dtypes = ("model", "fp8")

    def __init__(
        self,
        topk_ratio: float,
        sink: int,
        recent: int,
        dense_layers: int,
        transfer: str,
        cpu_threads: int | str,
        uva_programs: int | None = None,
        topk: str = "torch",
    ) -> None:
        super().__init__()
        check_budget(topk_ratio, sink, recent, dense_layers)
        cpu_threads = resolve_threads(cpu_threads)  # validated now, before any long work
        cores = resolve_threads("auto")
        if cpu_threads > cores:  # more threads than cores only time-slice: not the baseline at its strongest
            raise ConfigError(
                f"cpu_threads={cpu_threads} exceeds the {cores} cores this process may use; valid: 1..{cores}, auto"
            )
        TransferEngine(transfer, cpu_threads, torch.device("cpu"), uva_programs)  # validates the transfer now
        self.topk_ratio, self.sink, self.recent, self.dense_layers = topk_ratio, sink, recent, dense_layers
        check_topk_method(topk)
        self.transfer_kind, self.cpu_threads, self.uva_programs = transfer, cpu_threads, uva_programs
        self.topk = topk  # select_topk's method

    def k_select(self, prompt_len: int) -> int:
        return select_budget(prompt_len, self.topk_ratio, self.sink, self.recent)

    def _allocate(self, spec: KVSpec) -> None:
        if self.dense_layers > spec.num_layers:
            raise ConfigError(f"dense_layers={self.dense_layers} exceeds the model's {spec.num_layers} layers")
        self.pacer = link_pacer(spec)  # hardware.link_gb_s: every transfer at the cap; None: the real link
        self.transfer = TransferEngine(self.transfer_kind, self.cpu_threads, spec.device, self.uva_programs, self.pacer)
        L = spec.num_layers
        self.dense = DenseLayers(spec, self.dense_layers)
        self.window: list[torch.Tensor | None] = [None] * L
        rows = None if spec.prompt_len is None else self.host_rows(spec.prompt_len)  # None: allocated at prefill
        self.host = host_stores(spec, self.dense_layers, rows)  # pinned before the prefill, as CLO's
        self.offload = Offload(spec.device, self.pacer)  # each layer's host copy, behind the next layer (as CLO's)
        self.heads = torch.arange(spec.num_kv_heads, device=spec.device)
        self.t0 = 0
        self.link_gb_s = spec.link_bytes_per_s / 1e9  # what the system floor divides the moved bytes by, as CLO's

    def host_rows(self, t0: int) -> int:
        """Rows per head of a layer's host store for a t0-token prompt: its middle, padded."""
        n_mid = split_prompt(t0, self.sink, self.recent)[2]
        return n_mid + self.host_padding(n_mid)

    def prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The layer's prompt K/V: sink and recent rows into its device window; the middle staged on the device in
        the host store's layout (padding zeroed), indexed by the subclass, then copied to the host store by
        `offload` (on CUDA while the next layer computes), one contiguous copy."""
        self.offload.finish()  # the last layer's staged rows go before this layer's are made
        spec = self.spec
        b, hkv, t0, d = k.shape
        self.t0 = t0
        if layer in self.dense:
            self.dense.prefill(layer, torch.stack([k, v], dim=3))
            return
        sink, recent, n_mid = split_prompt(t0, self.sink, self.recent)
        self.window[layer] = prompt_window(k, v, sink, recent, spec.max_len)
        rows = k.new_empty(b, hkv, self.host_rows(t0), 2, d)
        rows[:, :, :n_mid, 0], rows[:, :, :n_mid, 1] = k[:, :, sink : sink + n_mid], v[:, :, sink : sink + n_mid]
        rows[:, :, n_mid:].zero_()  # RetroInfer's padding of a head's last block
        layer_store(self.host, layer, spec, self.dense_layers, rows.shape[2])
        # keys: a view, not a copy: a copy would be one more of the layer's K beside the prefill (1 GB at a 64 GiB
        # batch)
        behind = self.prefill_sparse(layer, k[:, :, sink : sink + n_mid], n_mid, rows)
        self.offload.start(rows, self.host[layer], behind)

    def end_prefill(self, prompt_len: int) -> None:
        self.offload.finish()  # decode reads the host stores
        super().end_prefill(prompt_len)

    def host_padding(self, n_mid: int) -> int:
        return 0

    def prefill_sparse(
        self, layer: int, keys_mid: torch.Tensor, n_mid: int, rows: torch.Tensor
    ) -> Callable[[], None] | None:
        """keys_mid [B, Hkv, n_mid, D]: the candidates of a sparse layer, a view of the prompt's keys. What is kept
        of it must be a copy (the retrievers' index copies): a view would keep the whole prompt's K alive. rows
        [B, Hkv, n_mid + padding, 2, D]: the device copy bound for the host store, which a subclass may reorder.
        Returns the work that reads only `rows` and may run behind the layer, with its host copy (as CLO encodes
        its keys), or None."""

    def begin_step(self) -> None:
        super().begin_step()
        self.dense.begin_step(self.length)

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if layer in self.dense:
            with self.phase("attention"):
                return self.dense.decode(layer, q, k, v, self.position)
        n_win = self.append_window(layer, k, v)
        k_sel = self.k_select(self.t0)
        sel, real = self.selected_rows(layer, q, k_sel) if k_sel else (None, None)  # [B, Hkv, k, 2, D], [B, Hkv, k]
        with self.phase("attention"):
            win = self.window[layer][:, :, :n_win]
            if sel is None:
                return attend(q, win)
            if self.spec.fp8:
                window = (win[:, :, :, 0].transpose(1, 2), win[:, :, :, 1].transpose(1, 2), self.n_win_of(n_win))
                return attend_packed(q, window, sel, real)
            keep = None if real is None else torch.cat([real.new_ones(real.shape[:2] + (n_win,)), real], dim=2)
            return attend(q, torch.cat([win, sel], dim=2), keep)

    def n_win_of(self, n_win: int) -> torch.Tensor:
        """The window's length for every sequence, as decode attention reads it."""
        return torch.full((self.spec.batch,), n_win, dtype=torch.long, device=self.spec.device)

    def model_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Selected host rows [..., 2, host_width] in the model's dtype (dequantised under kv_dtype=fp8): for the
        paths that attend them beside the window in one buffer (RetroInfer-style's estimation zone)."""
        return dequantize_rows(rows, self.spec.dtype) if self.spec.fp8 else rows

    def note_middle(self, layer: int, idx: torch.Tensor, real: torch.Tensor | None = None) -> None:
        """note_selection of the middle positions idx [B, Hkv, k] a subclass selected (real: which are tokens),
        with the window's sink and recent positions."""
        if self.selections is None:
            return
        sink, recent, n_mid = split_prompt(self.t0, self.sink, self.recent)
        b, hkv = idx.shape[:2]
        pos = (idx.view(b, hkv, -1) + sink).masked_fill(idx.view(b, hkv, -1) >= n_mid, -1)
        if real is not None:
            pos = pos.masked_fill(~real.view(b, hkv, -1), -1)
        window = window_positions(self.t0, sink, recent, idx.device)
        self.note_selection(layer, torch.cat([window.expand(b, hkv, -1), pos], dim=2))

    def append_window(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """The step's new token into the layer's window; returns the window's length with it."""
        sink, recent, _ = split_prompt(self.t0, self.sink, self.recent)
        n_win = sink + recent + self.length - self.t0 + 1
        self.window[layer][:, :, n_win - 1] = torch.stack([k, v], dim=2)
        return n_win

    def selected_rows(self, layer: int, q: torch.Tensor, k_sel: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(rows [B, Hkv, k_sel, 2, D] of the selected middle tokens, real [B, Hkv, k_sel] bool or None): `real`
        marks the rows that are tokens, where some are padding that attention must never see (RetroInfer's last,
        partial block); None when every row is a token (no mask: the unmasked attention path)."""
        raise NotImplementedError

    def common_parts(self) -> dict[str, int]:
        """Bytes of the buffers every baseline holds (real tensors)."""
        return {"window": sized(self.window), "dense_layers": self.dense.nbytes(), "host": sized(self.host)}

    def common_estimate(self, spec: KVSpec) -> dict[str, int]:
        """The same parts from the shapes alone, for the spec's prompt (the host store padded as prefill pads
        it)."""
        t0 = spec.prompt_tokens
        sink, recent, n_mid = split_prompt(t0, self.sink, self.recent)
        per_head = spec.batch * spec.num_kv_heads * spec.row_bytes
        sparse = spec.num_layers - min(self.dense_layers, spec.num_layers)
        host_per_head = spec.batch * spec.num_kv_heads * spec.host_row_bytes  # packed FP8 under kv_dtype=fp8
        return {
            "window": sparse * per_head * (sink + recent + spec.max_len - t0),
            "dense_layers": (spec.num_layers - sparse) * per_head * spec.max_len,
            "host": sparse * host_per_head * self.host_rows(t0),
        }

    def host_store_rows(self) -> list[torch.Tensor]:
        """Every sparse layer's host store as rows [N, 2 * D] (K and V of a token of a head), in layer order: what a
        CPU gather reads."""
        return [h.view(-1, 2 * self.spec.host_width) for h in self.host if h is not None]

    def pinned_host_bytes(self, spec: KVSpec) -> int:
        logical, pinned = host_stores_pinned(spec, self.dense_layers, self.host_rows(spec.prompt_tokens))
        return self.estimate_memory(spec).host_bytes - logical + pinned

    def step_device_bytes(self) -> int:
        """Per step, as CLO's: the attended rows (window, selected rows, dense layers) and the retrieval metadata
        (every candidate is scored)."""
        spec = self.spec
        sink, recent, _ = split_prompt(self.t0, self.sink, self.recent)
        heads = spec.batch * spec.num_kv_heads * sum(1 for w in self.window if w is not None)
        window = spec.row_bytes * (sink + recent + self.length - self.t0 + 1)
        selected = spec.host_row_bytes * self.k_select(self.t0)  # host rows: packed FP8 under kv_dtype=fp8
        return heads * (window + selected) + self.dense.step_bytes(self.length) + self.memory_parts()["metadata"]


def attend(q: torch.Tensor, kv: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D]; kv [B, Hkv, N, 2, D] -> [B, H, D]: dense attention over one buffer (the reference); keep
    [B, Hkv, N] bool, when given: only those rows are attended (the others get no weight at all)."""
    from baselines.fullattn import dense_decode_attention

    return dense_decode_attention(q, kv[:, :, :, 0], kv[:, :, :, 1], None if keep is None else keep[:, :, None])
