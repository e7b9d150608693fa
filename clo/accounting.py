"""What a CLO step did and what it had to read, counted from the stores' device state: the statistics of the
run's records (hits, bytes over the link) and CLO's own floor (the device bytes one step must read)."""

from __future__ import annotations

import torch

from clo.store import LayerStore


def count_step(stores: list[LayerStore | None], row: int) -> tuple[int, int, int, int, int]:
    """(lookups, hits, bytes moved host -> device, scored rows, prefetch refreshes) of the step just run; zeroes
    the stores' miss counters. One host sync for all layers.

    Every store with cached heads is looked up once per step (at prepare, or at decode without prefetch); the
    prefetch heads are refreshed every step by design and count as transfers, not as lookups. The scored rows
    are the (sequence, head) rows whose metadata the step's retrieval needed: the refreshed cached heads and
    every persistent head (on CUDA a cached head that hit is not scored)."""
    active = [st for st in stores if st is not None and st.nc and st.k]
    managed_misses = refreshes = 0
    if active:
        counts = torch.stack([torch.stack([(st.misses * ~st.prefetch_mask).sum(), st.misses.sum()]) for st in active])
        managed_misses, refreshes = counts.sum(0).tolist()
    lookups = sum(st.misses.shape[0] * st.n_managed for st in active)
    moved = refreshes * row * max((s.k for s in stores if s is not None), default=0)
    scored = refreshes + sum(
        st.window.shape[0] * (st.window.shape[1] - st.nc) for st in stores if st is not None and st.k
    )
    with torch.inference_mode():  # the buffers were made in (inference-mode) prefill
        for st in active:
            st.misses.zero_()
    return lookups, lookups - managed_misses, moved, scored, refreshes - managed_misses


def step_device_bytes(
    stores: list[LayerStore | None],
    metadata_bytes: int,
    scored_rows: int | None,
    length: int,
    row: int,
    slot_row: int | None = None,
) -> int:
    """Device bytes of the sparse layers one step reads: the attended rows (window, selected rows), the labels,
    and the retrieval metadata of the rows the last step needed scored (count_step's; every row before a step
    has run). On CUDA exactly those are read; the CPU reference scores every row. row: a window row's bytes;
    slot_row: a slot's (a host row: packed FP8 under kv_dtype=fp8), row by default."""
    slot_row = row if slot_row is None else slot_row
    stores = [st for st in stores if st is not None]
    rows = sum(st.window.shape[0] * st.window.shape[1] for st in stores)
    scored = rows if scored_rows is None else scored_rows
    total = metadata_bytes * scored // max(rows, 1)
    for st in stores:
        gen = length - st.t0 + 1
        heads = st.window.shape[0] * st.window.shape[1]
        total += heads * (row * (st.sink + st.recent + gen) + slot_row * st.k)
        total += st.labels.nbytes
    return total


def memory_parts(stores: list[LayerStore | None], metadata_bytes: int, dense_bytes: int) -> dict[str, int]:
    """CLO's device bytes by part (paper Table 6) and its host store, from the stores' real buffers."""
    parts = dict.fromkeys(("slots", "labels", "persistent", "window"), 0)
    parts.update(metadata=metadata_bytes, dense_layers=dense_bytes, host=0)
    for st in stores:
        if st is not None:
            for key, val in st.memory().items():
                parts[key] += val
    return parts
