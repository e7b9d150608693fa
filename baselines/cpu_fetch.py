"""InfiniGen's prefetch as its public code runs it at its best: the rows of layer l are gathered by the CPU and
copied to the device while the device computes layer l-1.

  submit(l) on the launch thread, after the device work that copies the flat row indices into a pinned buffer
            (an async copy, in or out of a graph): an event; a worker thread takes it from there, so the launch
            thread goes on launching layer l-1's attention and dense work
  worker    waits for the indices (the CPU-centric sync), then gathers the rows (torch.index_select on `threads`
            OpenMP threads; by default by the fetch's size: gather_threads) into pinned staging, chunk_rows rows at a
            time, each chunk's async copy to the device buffer issued as soon as it is gathered: the copy of one
            chunk overlaps the gather of the next
  wait(l)   the launch thread waits for the worker and makes the compute stream wait for the last copy (no
            device sync)

Staging and index buffers are pinned once, one pair per layer parity (layer l's fetch overlaps layer l-1's
attention, which reads the other parity's device buffer)."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvoffload.offload.link import LinkPacer, paced_copy
from kvoffload.offload.transfer import cpu_threads

# rows per gather + copy chunk (16 MiB of 512-byte rows). Every chunk costs the worker a Python iteration, which
# needs the GIL that the launch thread holds between launches, and an OpenMP fork/join: in a step, smaller chunks
# gather slower (which of the two costs more is not isolated); results/investigations/infinigen_cpu_fetch/
# compares sizes
CHUNK_ROWS = 32768


# a layer's fetch above which the gather uses every core, at BSZ > 1: fitted to the pairs of runs (half the cores
# against every core, in one device call) of results/investigations/infinigen_threads/. It lies between the largest
# fetch where half the cores stepped fastest at BSZ > 1 and the smallest where every core did. At BSZ 1 half the cores
# stepped fastest at every length measured up to 128K (not explained); the one BSZ 1 fetch above
# ALL_CORES_FETCH_BYTES_BSZ1 measured (512K) ran fastest on every core, in a run of its own, not a pair
# (results/LEDGER.md, fig10_throughput_512k)
ALL_CORES_FETCH_BYTES = 32 << 20
ALL_CORES_FETCH_BYTES_BSZ1 = 128 << 20


def gather_threads(cores: int, layer_bytes: int, batch: int) -> int:
    """The gather's threads for cpu_threads=auto, by the bytes one layer fetches and the batch. The gather is bound by
    host memory: a small one saturates it on half the cores, and leaving the other half to the launch thread and the
    driver keeps them from preempting a gather thread, which stalls the whole parallel gather at its join. A large
    one keeps every thread busy long enough that more threads gather faster."""
    threshold = ALL_CORES_FETCH_BYTES if batch > 1 else ALL_CORES_FETCH_BYTES_BSZ1
    return cores if layer_bytes > threshold else max(1, cores // 2)


class PipelinedFetcher:
    def __init__(
        self,
        rows: int,
        row_elems: int,
        dtype: torch.dtype,
        device: torch.device,
        threads: int,
        chunk_rows: int,
        pacer: LinkPacer | None = None,
    ) -> None:
        self.threads, self.chunk_rows = threads, chunk_rows
        self.pacer = pacer  # hardware.link_gb_s: each chunk's copy at the cap (None: the real link)
        self.staging = [torch.empty(rows, row_elems, dtype=dtype, pin_memory=True) for _ in range(2)]
        self.idx = [torch.empty(rows, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self.copied: list[torch.cuda.Event | None] = [None, None]  # each parity's last copy
        self.stream = torch.cuda.Stream(device)
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="infinigen-fetch")
        self.gather_ms = 0.0  # the worker's time in the CPU gathers since take_gathers
        self.gather_bytes = 0  # and the bytes they gathered
        self.last_parity: int | None = None  # the last fetch's (its indices are calibrate's)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.staging + self.idx)

    def submit(self, parity: int, host_rows: torch.Tensor, out_rows: torch.Tensor) -> Future:
        """Fetches the rows self.idx[parity] of host_rows [N, row_elems] (pinned) into out_rows [rows, row_elems]
        (device), in order; the current stream's work enqueued so far copies those indices (long, flat) into
        self.idx[parity]."""
        ready = torch.cuda.Event()
        ready.record()
        self.stream.wait_stream(torch.cuda.current_stream())  # out_rows may still be read by an earlier layer
        self.last_parity = parity
        return self.worker.submit(self._gather, parity, ready, host_rows, out_rows)

    def _gather(self, parity: int, ready: torch.cuda.Event, host_rows: torch.Tensor, out_rows: torch.Tensor):
        ready.synchronize()  # the indices are on the host
        if self.copied[parity] is not None:
            self.copied[parity].synchronize()  # this parity's staging is free again (long done, in practice)
        idx, staging = self.idx[parity], self.staging[parity]
        torch.set_num_threads(self.threads)  # this worker's gathers
        # inference mode is per thread: the decode step's buffers are inference tensors
        with torch.inference_mode(), torch.cuda.stream(self.stream):
            for a in range(0, idx.shape[0], self.chunk_rows):
                b = min(a + self.chunk_rows, idx.shape[0])
                t0 = time.perf_counter()
                torch.index_select(host_rows, 0, idx[a:b], out=staging[a:b])
                self.gather_ms += (time.perf_counter() - t0) * 1e3
                self.gather_bytes += (b - a) * staging.stride(0) * staging.element_size()
                paced_copy(self.pacer, out_rows[a:b], staging[a:b])
            done = torch.cuda.Event()
            done.record(self.stream)
        self.copied[parity] = done
        return done

    def take_gathers(self) -> tuple[float, int]:
        """The gathers' time (ms) and bytes since the last call (call it when no fetch is in flight: at the end of a
        step)."""
        out = (self.gather_ms, self.gather_bytes)
        self.gather_ms, self.gather_bytes = 0.0, 0
        return out

    def calibrate(self, stores: list[torch.Tensor]) -> dict[int, float]:
        """This machine's CPU gather bandwidth (GB/s) for the last fetch's indices gathered from each of `stores`
        (every sparse layer's host rows [N, row_elems], in layer order), measured alone (gather_gb_by_threads).
        Call it when no fetch is in flight, after at least one."""
        parity = self.last_parity
        if self.copied[parity] is not None:
            self.copied[parity].synchronize()  # the staging it overwrites is no longer being copied
        return gather_gb_by_threads(stores, self.staging[parity], self.threads, self.idx[parity], self.chunk_rows)

    @staticmethod
    def wait(fetch: Future) -> None:
        torch.cuda.current_stream().wait_event(fetch.result())


def gather_gb_by_threads(
    stores: list[torch.Tensor], staging: torch.Tensor, threads: int, idx: torch.Tensor, chunk_rows: int
) -> dict[int, float]:
    """gather_gb_s on a system's own `threads` and on every core this process may use: {threads: GB/s}. Alone, the
    count that is slower in a step can be the faster; a system's floor takes the best."""
    return {t: gather_gb_s(stores, staging, t, idx, chunk_rows) for t in sorted({threads, cpu_threads("auto")})}


def gather_gb_s(
    pools: torch.Tensor | list[torch.Tensor],
    staging: torch.Tensor,
    threads: int,
    idx: torch.Tensor | None = None,
    chunk_rows: int = CHUNK_ROWS,
    repeats: int = 3,
) -> float:
    """The best of `repeats` passes, each gathering the rows idx (default: staging's row count of random rows) of
    every pool [N, row_elems] in turn into staging, chunk_rows at a time on `threads` threads, as PipelinedFetcher's
    worker gathers but with nothing beside it (no copy, no decode step): the bandwidth that bounds the technique on
    this machine, the host part of InfiniGen's own floor. With a step's layers as the pools a pass reads what a step
    reads, layer after layer; repeating one layer's gather would read its rows from the CPU's cache from the second
    time on, faster than any step can (a layer's rows are a few MB at small batches). A step's own indices are its
    access pattern (each head's top-k lies in that head's rows, which random rows over the whole store are not).
    Reads the pools, writes staging only."""
    pools = [pools] if isinstance(pools, torch.Tensor) else pools
    if idx is None:
        n = min(p.shape[0] for p in pools)
        idx = torch.randint(n, (min(staging.shape[0], n),), generator=torch.Generator().manual_seed(0))
    rows = idx.shape[0]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    best = float("inf")
    try:
        with torch.inference_mode():
            for _ in range(repeats):
                t0 = time.perf_counter()
                for pool in pools:
                    for a in range(0, rows, chunk_rows):
                        b = min(a + chunk_rows, rows)
                        torch.index_select(pool, 0, idx[a:b], out=staging[a:b])
                best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return len(pools) * rows * pools[0].stride(0) * pools[0].element_size() / best / 1e9
