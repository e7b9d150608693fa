"""experiments.traces.memory_peak replays a CUDA allocator history: the allocations alive at the peak, grouped by the
project frame that made them (a synthetic history here; the GPU run writes the real one)."""

import pickle

import pytest

from experiments.traces.memory_peak import main, summarise

GB = 1024**3


def ev(action, addr, size, file="/x/kvoffload/model/decoder.py", line=1):
    return {"action": action, "addr": addr, "size": size, "frames": [{"filename": file, "line": line, "name": "f"}]}


def test_the_peak_is_the_largest_live_set_grouped_by_our_frame(tmp_path):
    history = [
        ev("alloc", 1, 2 * GB, "/x/clo/prefill.py", 10),
        ev("alloc", 2, 1 * GB, "/x/clo/prefill.py", 10),
        ev("free_completed", 1, 2 * GB),
        ev("alloc", 3, 4 * GB, "/x/clo/store.py", 5),  # peak: 1 + 4 GB
        ev("free_completed", 3, 4 * GB),
        ev("alloc", 4, 3 * GB),
        ev("free_completed", 99, 1),  # allocated before the history began
    ]
    s = summarise({"device_traces": [history]})
    assert s["peak_gb"] == 5 and s["peak_event"] == 3 and s["unmatched_frees"] == 1
    assert [(g["where"], g["gb"]) for g in s["live_at_peak"]] == [
        ("clo/store.py:5 f", 4.0),
        ("clo/prefill.py:10 f", 1.0),
    ]
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [history]}))
    main([str(path), "--out", str(tmp_path / "peak.json")])
    assert '"peak_gb": 5.0' in (tmp_path / "peak.json").read_text()


def test_a_snapshot_without_history_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no allocation history"):
        summarise({"device_traces": [[]]})
