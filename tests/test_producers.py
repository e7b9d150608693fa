"""The figure producers on the CPU at tiny sizes: experiments.producers.fig4_6_similarity (every sample
recomputed from the queries it saw) and experiments.bench.bench_link (its record's rows, checked rows, refusals); each
record drawn."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from experiments.bench import bench_link
from experiments.producers.fig4_6_similarity import measure, out_path
from kvoffload.errors import ConfigError
from plots import fig3_13_link, fig4_6_similarity
from tests.test_config import CONF
from tests.test_reuse_profile import TINY, tiny_decode


def config(tmp_path, *overrides):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose(
            "config",
            overrides=["seqlen=1200", "workload.gen_tokens=6", "workload.stop_at_eos=false", "device=cpu", *TINY]
            + [f"+similarity_out={tmp_path / 'sim' / 'record.json'}", *overrides],
        )


@pytest.mark.slow
def test_similarity_record_holds_every_sample(tmp_path):
    probes = []
    data = measure(config(tmp_path), decode=lambda cfg, make_kv, min_steps: tiny_decode(cfg, make_kv, keep=probes))
    (probe,) = probes
    assert data["decode_steps"] == 5 and data["shape"] == {"layers": 3, "heads": 4, "kv_heads": 2}
    for layer in range(3):
        q = [step[0] for step in probe.queries[layer]]  # [B, H, D] per step
        for h in range(4):
            want = [torch.nn.functional.cosine_similarity(q[t][0, h], q[t - 1][0, h], dim=0) for t in range(1, 5)]
            assert data["query_cos"][layer][h] == pytest.approx([float(w) for w in want], abs=1e-4)
        assert len(data["topk_overlap"][layer]) == 2 and all(len(x) == 4 for x in data["topk_overlap"][layer])
    path = tmp_path / "sim" / "record.json"
    path.parent.mkdir()
    path.write_text(json.dumps(data))
    d = fig4_6_similarity.plot(path.parent, tmp_path / "fig4_6.png")
    assert d["cos"].shape == (3, 4, 4) and 0 <= d["above"] <= 1
    with pytest.raises(ConfigError, match="exists: force=true"):
        out_path(config(tmp_path))
    with pytest.raises(ConfigError, match="batch must be 1"):
        measure(config(tmp_path, "batch=2"), decode=tiny_decode)


def test_link_bench_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "link" / "record.json"
    bench_link.main(["--out", str(out), "--tokens", "64,256", "--kv-heads", "2", "--head-dim", "8", "--iters", "2"])
    rec = json.loads(out.read_text())
    assert rec["device"] == "cpu" and rec["shape"] == {"kv_heads": 2, "head_dim": 8, "row_bytes": 32}
    assert [(r["path"], r["tokens"], r["threads"]) for r in rec["rows"]] == [
        ("bulk", 64, None),
        ("cpu_gather", 64, None),  # on a CPU the thread counts do not apply
        ("bulk", 256, None),
        ("cpu_gather", 256, None),
    ]
    assert all(r["exact_rows"] for r in rec["rows"] if r["path"] != "bulk")
    assert all(r["bytes"] == r["tokens"] * 2 * 32 and r["gb_s"] > 0 for r in rec["rows"])
    assert rec["command"].startswith("python -m experiments.bench.bench_link --out")
    fig3_13_link.plot(out.parent, tmp_path / "link.png")
    assert rec["link_caps_gb_s"] == [] and rec["mechanism"] is None
    # a record with paced rows (--link-gb-s on a GPU) draws the real link's rows only
    rec["rows"].append({**rec["rows"][0], "gb_s": 1e-6, "cap_gb_s": 8.0, "of_cap": 0.0})
    out.write_text(json.dumps(rec))
    assert all("cap_gb_s" not in r for r in fig3_13_link.data(out.parent)["rows"])
    for bad, why in (
        (["--tokens", "0"], "at least 1"),
        (["--fraction", "2"], "must be in (0, 1]"),
        (["--link-gb-s", "8,0"], "--link-gb-s='0' must be above 0"),
        (["--link-gb-s", "21.21"], "--link-gb-s=21.21 caps a GPU's host link; a cpu run has none"),
    ):
        with pytest.raises(SystemExit) as e:
            bench_link.main(["--out", str(tmp_path / "x.json"), "--device", "cpu", *bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and why in err and len(err.strip().splitlines()) == 1, err


def test_block_copy_bench_on_the_cpu(tmp_path, capsys):
    from experiments.bench import bench_block_copy

    out = tmp_path / "block_copy.json"
    bench_block_copy.main(["--out", str(out), "--seqlens", "256", "--batches", "1,2", "--iters", "2"])
    rec = json.loads(out.read_text())
    assert [(r["path"], r["batch"]) for r in rec["rows"]] == [
        (p, b) for b in (1, 2) for p in ("bulk", "blocks", "rows")
    ]
    assert all(r["exact"] for r in rec["rows"] if r["path"] != "bulk")
    row = rec["rows"][0]  # 256 tokens, 8-token blocks, top-k 10 %: 4 lookups a row, 8 rows; 15 % of them miss
    assert (row["lookups"], row["misses"], row["bytes"]) == (32, 5, 5 * 8 * 512)
    with pytest.raises(SystemExit) as e:
        bench_block_copy.main(["--out", str(tmp_path / "x.json"), "--hit", "1"])
    assert e.value.code == 2 and "[0, 1)" in capsys.readouterr().err


def test_host_gather_bench_on_the_cpu(tmp_path, capsys):
    """experiments.bench.bench_host_gather: a row per (pool, memory kind, index pattern, threads, chunk), every gather
    exact; bad input refused with one line and exit status 2."""
    from experiments.bench import bench_host_gather

    out = tmp_path / "gather.json"
    args = ["--out", str(out), "--tokens", "512", "--heads", "2", "--threads", "1", "--chunks", "64,4096"]
    bench_host_gather.main([*args, "--kinds", "pageable"])
    rec = json.loads(out.read_text())
    assert [(r["pattern"], r["chunk"]) for r in rec["rows"]] == [
        (p, c) for p in ("random", "head_sorted", "head_unsorted") for c in (64, 4096)
    ]
    assert all(r["exact_rows"] and r["rows"] == 2 * 51 and r["gb_s"] > 0 for r in rec["rows"])
    for bad, why in ((["--threads", "0"], "at least 1"), (["--kinds", "numa"], "each one of")):
        with pytest.raises(SystemExit) as e:
            bench_host_gather.main([*args, *bad])
        assert e.value.code == 2 and why in capsys.readouterr().err


def test_lru_bench_on_the_cpu(tmp_path, capsys):
    """experiments.bench.bench_lru: a row per (point, threads, mode), the deferred mode's hit rate the inline one's (the
    same decisions), its state change timed apart; bad input refused with one line and exit status 2."""
    from experiments.bench import bench_lru

    out = tmp_path / "lru.json"
    args = ["--out", str(out), "--points", "1k:1,1k:2", "--threads", "1", "--steps", "12"]
    bench_lru.main(args)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["mode"]) for r in rows] == [(b, m) for b in (1, 2) for m in ("inline", "deferred")]
    assert rows[0]["hit_rate"] == rows[1]["hit_rate"] > 0.5 and "update_us" in rows[1]
    assert all(r["critical_us"] > 0 and r["rows"] == 8 * r["batch"] for r in rows)
    for bad, why in ((["--points", "1k"], "seqlen:batch"), (["--keep", "1"], "must be in [0, 1)")):
        with pytest.raises(SystemExit) as e:
            bench_lru.main([*args, *bad])
        assert e.value.code == 2 and why in capsys.readouterr().err


def test_the_infinigen_fetch_readme_is_current():
    """results/investigations/infinigen_cpu_fetch/README.md is what its generator makes of the records beside it."""
    from kvoffload.paths import ROOT
    from plots.infinigen_fetch_readme import readme

    folder = ROOT / "results" / "investigations" / "infinigen_cpu_fetch"
    assert (folder / "README.md").read_text() == readme(folder)


def test_the_table5_gap_interval_is_paired_and_covers_the_gap():
    """Paired: a system that scores FullAttn's sample for sample has the interval [0, 0] however the samples vary; a
    gap on some samples gives an interval around it. A system that scored the first of FullAttn's documents is paired
    on those (an ablation beside a cell rerun with more samples); a document FullAttn did not score is refused."""
    from plots.tab5_readme import paired_interval

    ref = {i: float(i % 2) for i in range(20)}
    same = {("fullattn", "a@2048"): ref, ("clo", "a@2048"): dict(ref)}
    assert paired_interval(same, "clo", ["a@2048"]) == (0.0, 0.0)
    worse = {**same, ("clo", "a@2048"): {i: 0.0 if i < 4 else v for i, v in ref.items()}}  # 2 of 20 lost: 10 points
    lo, hi = paired_interval(worse, "clo", ["a@2048"])
    assert 0 <= lo < 10 < hi <= 25
    first4 = {**same, ("clo", "a@2048"): {i: 0.0 for i in range(4)}}  # FullAttn 0, 1, 0, 1 there: 50 points above
    lo, hi = paired_interval(first4, "clo", ["a@2048"])
    assert 0 <= lo < 50 < hi <= 100
    with pytest.raises(SystemExit, match="did not"):
        paired_interval({**same, ("clo", "a@2048"): {20: 1.0}}, "clo", ["a@2048"])


@pytest.mark.slow
def test_pin_alloc_bench_on_the_cpu(tmp_path, capsys):
    """experiments.bench.bench_pin_alloc: a row per way of pinning, each from a process of its own, with the link
    measured on memory made that way; bad input refused with one line and exit status 2."""
    from experiments.bench import bench_pin_alloc

    out = tmp_path / "pin_alloc.json"
    argv = ["--out", str(out), "--gib", "0.01", "--layer-gib", "0.005", "--threads", "0,2", "--link-tokens", "64"]
    argv += ["--alloc-threads", "2", "--thp-threads", "2"]
    bench_pin_alloc.main(argv)
    rec = json.loads(out.read_text())
    assert rec["bench"] == "pin_alloc" and rec["link_tokens"] == 64
    assert [(r["way"], r["threads"], r["alloc_threads"], r["layers"], r["thp"]) for r in rec["rows"]] == [
        ("cudaHostAlloc", 0, 1, 2, False),
        ("cudaHostRegister", 2, 1, 2, False),
        ("cudaHostRegister + THP", 2, 1, 2, True),  # its process started with glibc's huge-page tunable
        ("cudaHostAlloc", 0, 2, 2, False),  # called from two threads at once
    ]
    assert not any(r["pinned"] for r in rec["rows"]) and all(r["anon_huge_gib"] >= 0 for r in rec["rows"])
    for r in rec["rows"]:
        assert [x["path"] for x in r["link"]] == ["bulk", "cpu_gather"] and r["link"][1]["exact_rows"]
        assert r["bytes"] == 2 * int(0.005 * 2**30) and r["alloc_s"] >= 0 and r["free_s"] >= 0
    with pytest.raises(SystemExit) as e:
        bench_pin_alloc.main(["--out", str(tmp_path / "x.json"), "--threads", "0,12"])
    assert e.value.code == 2 and "power of two" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bench_pin_alloc.main(["--out", str(tmp_path / "x.json"), "--alloc-threads", "0"])
    assert e.value.code == 2 and "--alloc-threads" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bench_pin_alloc.main(["--out", str(tmp_path / "x.json"), "--thp-threads", "0"])
    assert e.value.code == 2 and "cudaHostAlloc does not use" in capsys.readouterr().err


@pytest.mark.slow
def test_the_huge_page_tunable_reaches_malloc():
    """hardware.pin_huge_pages and bench_pin_alloc's THP way: a process started with thp_env's GLIBC_TUNABLES places
    a touched 64 MiB buffer on transparent huge pages where the system's THP mode is "madvise" (glibc >= 2.35), and
    one without it does not; elsewhere the check is skipped with the mode."""
    from kvoffload.offload.host import thp_env

    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[madvise]" not in mode.read_text():
        pytest.skip(f"THP mode: {mode.read_text().strip() if mode.exists() else 'none'}")
    code = (
        "import torch; from kvoffload.offload.host import anon_huge_gib;"
        "x = torch.empty(64 << 20, dtype=torch.uint8); x.fill_(1); print(anon_huge_gib())"
    )
    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    huge = [
        float(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout)
        for env in (base, thp_env(base | {"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}))
    ]
    assert huge[0] < 0.03 and huge[1] >= 0.05, huge


def test_skew_eigh_bench_on_the_cpu(tmp_path):
    """experiments.bench.bench_skew_eigh: a row for the device's eigh and one per host thread count, and the two
    subspaces' gap (on a CPU both are the host's: the same decomposition)."""
    from experiments.bench import bench_skew_eigh

    out = tmp_path / "skew_eigh.json"
    bench_skew_eigh.main(["--out", str(out), "--matrices", "4", "--head-dim", "16", "--rank", "5", "--iters", "1"])
    rec = json.loads(out.read_text())
    assert rec["rows"][0]["where"] == "cpu" and {r["threads"] for r in rec["rows"][1:]} >= {1}
    assert all(r["s"] > 0 and r["ms_per_matrix"] > 0 for r in rec["rows"]) and rec["gap"] < 1e-3
