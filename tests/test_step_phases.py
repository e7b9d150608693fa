"""experiments.runner.trace_phases: a traced step's compute-stream time by phase, its idle gaps charged to what it
waited for (synthetic events here; the committed baseline traces are real ones)."""

from pathlib import Path

import pytest

from experiments.runner.trace_phases import load_events, phase_of, step_phases
from experiments.traces.step_timeline import copies, summary

RESULTS = Path(__file__).resolve().parent.parent / "results"


def k(name, stream, start, end):
    return {"name": name, "stream": stream, "start": start, "end": end}


def test_kernels_and_gaps_take_their_phases():
    events = [
        k("_gemv_kernel", 7, 0, 100),
        k("_hash_score_kernel", 9, 90, 150),  # side stream: the compute stream waits 100 -> 160 for it
        k("_split_kernel", 7, 160, 200),
        k("Memcpy HtoD (Pinned -> Device)", 25, 150, 400),  # the link: 200 -> 410 waited for
        k("_merge_kernel", 7, 410, 420),
        k("_rms_norm_kernel", 7, 500, 520),  # 420 -> 500: nothing on another stream, the host's gap
        k("_gemv_kernel", 7, 520.5, 600),  # back to back: launch, counted with the work
    ]
    ph = step_phases(events)
    assert ph["other"] == pytest.approx((100 + 20 + 0.5 + 79.5) / 1e3)
    assert ph["retrieval"] == pytest.approx(60 / 1e3) and ph["attention"] == pytest.approx(50 / 1e3)
    assert ph["transfer_exposed"] == pytest.approx(210 / 1e3) and ph["launch_sync"] == pytest.approx(80 / 1e3)
    assert sum(ph.values()) == pytest.approx(0.6)  # the compute stream's span


def test_names_map_to_phases():
    assert phase_of("_uva_gather_kernel") == "transfer_exposed"
    assert phase_of("void at::native::sbtopk::gatherTopK<float>") == "retrieval"
    assert phase_of("void pytorch_flash::flash_fwd_splitkv_kernel<x>") == "attention"
    assert phase_of("_gemv_kernel") == "other"


def test_a_committed_retroinfer_trace_splits_into_its_span():
    events = load_events(RESULTS / "fair_baselines_128k" / "trace_retroinfer.json.gz")
    ph = step_phases(events)
    assert ph["transfer_exposed"] > 5 and ph["retrieval"] > 1 and ph["launch_sync"] > 5  # its LRU waits on the host
    with pytest.raises(ValueError, match="no GPU kernels"):
        step_phases([])


def test_timeline_sums_kernel_families_over_the_streams_of_a_replayed_graph():
    events = [
        k("nvjet_sm90_tst_128x8", 7, 0, 10),
        k("void at::native::vectorized_elementwise_kernel<4>", 7, 10, 12),
        k("void at::native::reduce_kernel<512>", 31, 12, 15),  # another branch's stream
        k("_uva_gather_kernel", 31, 15, 40),
        k("_uva_gather_kernel", 32, 40, 60),
    ]
    fam = {r["name"]: (r["us"], r["launches"]) for r in summary(events, 3)["busy_us_by_family"]}
    assert fam == {"_uva_gather_kernel": (45.0, 2), "cublas": (10.0, 1), "torch": (5.0, 2)}


def test_timeline_reports_copies_and_the_host_round_trip_after_each_read_back():
    events = [
        {**k("_topk", 7, 0, 10), "bytes": None},
        {**k("Memcpy DtoH (Device -> Pinned)", 7, 10, 12), "bytes": 2000},
        {**k("Memcpy HtoD (Pinned -> Device)", 21, 62, 162), "bytes": 5_000_000},  # 50 GB/s, 50 us after the read
        {**k("_attention", 7, 170, 180), "bytes": None},
        {**k("Memcpy DtoH (Device -> Pinned)", 7, 180, 181), "bytes": 2000},
        {**k("Memcpy HtoD (Pinned -> Device)", 21, 211, 261), "bytes": 1_000_000},  # 20 GB/s, 30 us after
    ]
    c = copies(events)
    assert c["HtoD"] == {"copies": 2, "median_bytes": 3_000_000, "median_us": 75.0, "median_gb_s": 35.0}
    events.append({**k("Memcpy HtoD (Pinned -> Device)", 7, 262, 263), "bytes": 4})  # a length, not data
    c = copies(events)
    assert c["HtoD"]["copies"] == 3 and c["HtoD"]["median_bytes"] == 1_000_000
    assert c["HtoD"]["bulk"] == {"copies": 2, "median_bytes": 3_000_000, "median_us": 75.0, "median_gb_s": 35.0}
    assert "bulk" not in c["DtoH"]  # every read-back is small: no second set
    assert c["DtoH"]["copies"] == 2 and "DtoD" not in c
    assert c["idle_after_dtoh_us"] == {"median": 40.0, "sum": 80.0}


def test_a_committed_infinigen_trace_shows_its_copies():
    c = copies(load_events(RESULTS / "investigations" / "infinigen_step_8k" / "trace_infinigen_8k_b1.json.gz"))
    # a fetch and a read-back per sparse layer (and the window's length, in the attention's graph)
    assert c["HtoD"]["bulk"]["copies"] == 30 and c["DtoH"]["copies"] == 30
    assert c["HtoD"]["bulk"]["median_bytes"] > 1e6 > c["DtoH"]["median_bytes"]
