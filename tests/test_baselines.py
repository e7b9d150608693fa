"""The RetroInfer- and InfiniGen-style baselines through the KVOffloadSystem API (CPU reference path): with the
exact retriever (any cache size) RetroInfer-style output equals exact top-k attention recomputed from the full KV;
InfiniGen-style does too with the real query; RetroInfer's wave index, InfiniGen's skew file and CPU gather; bad
input is refused; both run the run command with real SmolLM2 and give FullAttn's answer."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from baselines.cpu_fetch import ALL_CORES_FETCH_BYTES, ALL_CORES_FETCH_BYTES_BSZ1, gather_threads
from baselines.infinigen import InfiniGen
from baselines.retroinfer import RetroInfer
from clo.plan import k_select
from clo.system import CLO
from kvoffload.errors import ConfigError
from kvoffload.kv.interface import KVSpec
from tests.baseline_helpers import (
    CPU,
    HKV,
    K_SEL,
    RATIO,
    RECENT,
    SINK,
    T0,
    B,
    D,
    G,
    H,
    L,
    assert_outputs,
    exact_topk,
    feed,
    make,
    reference,
    spec,
)
from tests.reference import exact_topk_attention


@pytest.mark.parametrize("cache_multiple", [100.0, 1.0])  # holds everything | evicts and bypasses every step
@pytest.mark.parametrize("block_size", [8, 5])
def test_retroinfer_with_exact_retriever_equals_exact_topk_attention(cache_multiple, block_size):
    s = make(
        RetroInfer,
        retriever="exact",
        block_size=block_size,
        cache_multiple=cache_multiple,
        dense_layers=1,
        selection="token",
    )
    got, (k0, v0, data), stats = feed(s)
    assert_outputs(got, reference(k0, v0, data, dense_layers=1))
    if cache_multiple > 10:  # everything fits: after the first step only newly retrieved blocks miss
        assert s.geometry(T0)[2] == s.geometry(T0)[0] and stats[-1].hits > 0
    else:
        assert s.evictions > 0


def test_retroinfer_block_selection_attends_whole_top_blocks_and_moves_no_extra_bytes():
    """Default selection: the k // block_size blocks with the best token, exactly, the partial last block among
    the candidates (T0's middle, 111 tokens, is 13 blocks of 8 and one of 7); a miss moves only the selected
    blocks' rows (no block amplification; the partial block's padding row travels with it, never attended)."""
    bs = 8
    s = make(RetroInfer, retriever="exact", block_size=bs, cache_multiple=100.0)
    k_blk = s.k_select(T0)
    assert k_blk == (K_SEL // bs) * bs and k_blk > 0
    got, (k0, v0, data), stats = feed(s)
    assert_outputs(got, exact_topk_attention(k0, v0, data, SINK, RECENT, k_blk // bs, block_size=bs))
    for st in stats:
        assert st.bytes_h2d == (st.lookups - st.hits) * bs * 2 * D * 4 <= L * B * HKV * k_blk * 2 * D * 4


def test_infinigen_with_the_true_query_equals_exact_topk_attention():
    s = make(InfiniGen, oracle_query=True)
    got, (k0, v0, data), stats = feed(s)
    assert_outputs(got, reference(k0, v0, data))
    assert stats[-1].bytes_h2d == L * B * HKV * K_SEL * 2 * D * 4 and stats[-1].host_syncs == 2 * L


def test_infinigen_speculation_with_all_channels_and_the_true_query_is_exact():
    """The speculative path itself: prepare() one layer ahead, skewed partial keys; with every channel kept the
    skew is an orthogonal change of basis, so the scores (and the top-k) are exact."""
    s = make(InfiniGen, channel_fraction=1.0)
    got, (k0, v0, data), _ = feed(s, speculate_with_true_query=True)
    assert_outputs(got, reference(k0, v0, data))


def test_infinigen_partial_channels_recover_most_of_the_exact_topk():
    s = make(InfiniGen, channel_fraction=0.5)
    g = torch.Generator().manual_seed(3)
    # keys with a few dominant directions (as real keys): the partial channels then carry most of q.k
    keys = torch.randn(B, HKV, T0, 4, generator=g) @ torch.randn(4, D, generator=g) * 3 + 0.1 * torch.randn(
        B, HKV, T0, D, generator=g
    )
    for layer in range(L):
        s.prefill(layer, keys, torch.randn(B, HKV, T0, D, generator=g))
    s.end_prefill(T0)
    q = torch.randn(B, H, D, generator=g)
    s.fetch(0, q)
    got = s.pending.pop(0)[0][:, :, :, 0]  # fetched keys [B, HKV, k, D]
    for b in range(B):
        for h in range(HKV):
            want = set(exact_topk(q[b, h * G : (h + 1) * G], keys[b, h]).tolist())
            fetched = {int(torch.nonzero((keys[b, h] == row).all(-1))[0]) for row in got[b, h]}
            assert len(want & fetched) >= 0.8 * K_SEL


def test_budget_rule_is_clos():
    for t0 in (50, 123, 3072, 131072):
        clo = CLO(sink=SINK, recent=RECENT, topk_ratio=RATIO)
        assert RetroInfer(sink=SINK, recent=RECENT, topk_ratio=RATIO, selection="token").k_select(t0) == k_select(
            clo.cfg, t0
        )


@pytest.mark.parametrize(
    "make_bad, match",
    [
        (lambda: RetroInfer(block_size=0), "block_size"),
        (lambda: RetroInfer(cache_multiple=0.5), "working set"),
        (lambda: RetroInfer(cpu_threads=0), "cpu_threads"),
        (lambda: InfiniGen(cpu_threads=0), "cpu_threads"),
        (lambda: RetroInfer(cpu_threads=100_000), "exceeds the .* cores"),
        (lambda: RetroInfer(retriever="ivf"), "retriever"),
        (lambda: RetroInfer(retriever="wave", wave_cluster_size=0), "cluster_size"),
        (lambda: RetroInfer(transfer="dma"), "transfer"),
        (lambda: RetroInfer(uva_programs=0), "uva_programs"),
        (lambda: RetroInfer(lru_update="async"), "lru_update"),
        (lambda: InfiniGen(topk="heap"), "topk"),
        (lambda: InfiniGen(channel_fraction=0.0), "channel_fraction"),
        (lambda: InfiniGen(fetch_chunk_rows=0), "fetch_chunk_rows"),
        (lambda: InfiniGen(dense_layers=L + 1).allocate(spec()), "dense_layers"),
        (lambda: InfiniGen(graphs="always"), "graphs"),
        (lambda: InfiniGen(graphs="on").allocate(spec()), "graphs=on needs a CUDA device"),
    ],
)
def test_bad_input_is_a_config_error(make_bad, match):
    with pytest.raises(ConfigError, match=match):
        make_bad()


ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.parametrize("system", ["retroinfer", "infinigen"])
def test_run_command_with_real_smollm2(system, tmp_path):
    env = {**os.environ, "WANDB_SILENT": "true", "HYDRA_FULL_ERROR": "0"}
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.run",
            f"system={system}",
            "wandb.enabled=false",
            f"results_dir={tmp_path / 'results'}",
            f"hydra.run.dir={tmp_path / 'out'}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    (path,) = (tmp_path / "results").glob("*/record.json")
    rec = json.loads(path.read_text())
    assert rec["status"] == "ok" and rec["system"] == system and "real SmolLM2" in rec["weights"]
    assert rec["answer"]["found"] is True, rec["answer"]
    m = rec["metrics"]
    assert m["bytes_h2d_per_step"] > 0 and m["host_syncs_per_step"] > 0 and m["phase_ms_per_step"]["attention"] > 0
    if system == "retroinfer":
        assert 0 < m["hit_rate"] < 1 and m["phase_ms_per_step"]["cache_mgmt"] > 0
    assert rec["system_state"]["memory_parts"]["host"] > 0


@pytest.mark.slow
def test_real_smollm2_needle_answers_equal_fullattn(smollm2_folder):
    """At the default top-k 10 %, both baselines give FullAttn's greedy answer on the needle prompt."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from transformers import AutoTokenizer

    from baselines.fullattn import FullAttn
    from experiments.workloads.prompts import build_prompt
    from kvoffload.generate import generate
    from kvoffload.model.config import ModelConfig
    from kvoffload.model.weights import hf_decoder

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfgs = {name: compose("config", overrides=[f"system={name}"]) for name in ("retroinfer", "infinigen")}
    mcfg = ModelConfig.from_mapping(cfgs["retroinfer"].model)
    model = hf_decoder(mcfg, smollm2_folder, CPU, torch.float32)
    tok = AutoTokenizer.from_pretrained(str(smollm2_folder))
    prompt = build_prompt("needle", 3072, 1, 0, tok)

    def text(system):
        system.allocate(
            KVSpec(mcfg.num_layers, 1, 3072 + 24, mcfg.num_heads, mcfg.num_kv_heads, mcfg.head_dim, torch.float32, CPU)
        )
        return tok.decode(
            generate(model, system, prompt.tokens, 24, {tok.eos_token_id}).tokens[0], skip_special_tokens=True
        )

    want = text(FullAttn())
    assert prompt.answer in want
    for name, cfg in cfgs.items():
        assert text(instantiate(cfg.system)) == want, name


def test_infinigen_offline_skew_file_is_used_and_checked():
    bases = torch.linalg.qr(torch.randn(L, HKV, D, D)).Q.to(torch.float16)
    path = Path(tempfile.mkdtemp()) / "skew.pt"
    torch.save(bases, path)
    s = make(InfiniGen, skew=str(path), channel_fraction=0.5)
    feed(s)
    torch.testing.assert_close(s.basis[1][0], bases[1, :, :, : D // 2].float())
    assert "offline" in s.describe()["skew"]
    torch.save(bases[:, :1], path)
    with pytest.raises(ConfigError, match="shape"):
        make(InfiniGen, skew=str(path))
    with pytest.raises(ConfigError, match="no such file"):
        make(InfiniGen, skew=str(path) + ".missing")


# ---- RetroInfer's wave index -------------------------------------------------------------------------------
def test_wave_index_recovers_planted_clusters_and_retrieves_the_best_first():
    """Keys around 3 well-separated centres, interleaved in token order: k-means (6 clusters, each centre among
    the evenly spaced starting keys) keeps every cluster to one centre, the layout makes each cluster a
    contiguous run, and a query along one centre retrieves that centre's keys before any other."""
    from baselines.wave_index import WaveRetriever

    g = torch.Generator().manual_seed(0)
    centres = torch.nn.functional.normalize(torch.randn(3, D, generator=g), dim=-1) * 4
    truth = (torch.arange(96) % 3).expand(B, HKV, 96)
    keys = centres[truth] + 0.05 * torch.randn(B, HKV, 96, D, generator=g)
    w = WaveRetriever(1, cluster_size=16, segment=96, iters=6)
    w.index(0, keys)
    ordered = truth.gather(2, w.perm[0])  # the true centre of each position, in the cluster-ordered layout
    runs = (ordered[..., 1:] != ordered[..., :-1]).sum(-1)
    assert (runs <= 5).all()  # 6 pure clusters in a row: at most 5 changes of centre (interleaved: 95)
    q = torch.zeros(B, H, D)
    q[:, :, :] = centres[2]
    top = w.scores(0, q, torch.arange(HKV)).topk(4, dim=-1).indices
    assert (ordered.gather(2, top) == 2).all()


def test_wave_index_with_one_key_per_cluster_is_the_exact_retriever():
    """cluster_size 1: every key its own centroid, the layout the token order, the scores q . k: RetroInfer with
    the wave index and no estimation zone equals exact top-k attention, as with the exact retriever."""
    s = make(
        RetroInfer,
        retriever="wave",
        wave_cluster_size=1,
        wave_estimate=0,
        block_size=5,
        cache_multiple=100.0,
        dense_layers=1,
        selection="token",
    )
    got, (k0, v0, data), _ = feed(s)
    assert_outputs(got, reference(k0, v0, data, dense_layers=1))


def test_retroinfer_with_the_wave_index_attends_real_rows_of_its_clusters():
    """The permuted host store still pairs every key with its value: at top-k 100% RetroInfer with the wave
    index (which attends every middle token, in cluster order) equals dense attention."""
    kw = dict(topk_ratio=1.0, dense_layers=0, cache_multiple=100.0, selection="token", block_size=4)
    s = RetroInfer(sink=SINK, recent=RECENT, retriever="wave", wave_segment=40, cpu_threads=2, **kw)
    s.allocate(spec())
    got, (k0, v0, data), stats = feed(s)
    want = exact_topk_attention(k0, v0, data, SINK, RECENT, T0 - SINK - RECENT, 0)
    assert_outputs(got, want)
    assert "wave index" in s.describe()["retriever"]
    assert s.describe()["lru_step_threads"] == [1]  # a few lookups a layer: the calling thread (NATIVE_PARALLEL_MIN)


def test_retroinfers_lru_is_timed_as_its_host_work():
    """The CPU-side LRU of every sparse layer is the step's host work (StepStats.host_work_ms), the third part of
    the system's own floor; FullAttn-like dense decoding has none."""
    s = make(RetroInfer, retriever="exact")
    _, _, stats = feed(s)
    assert all(st.host_work_ms > 0 for st in stats)
    dense = make(RetroInfer, retriever="exact", dense_layers=L)
    assert all(st.host_work_ms == 0 for st in feed(dense)[2])


def test_the_cpu_gather_calibration_gathers_whole_rows_and_reports_a_bandwidth():
    """InfiniGen-style's floor divides its gathered bytes by this (baselines/cpu_fetch.gather_gb_s)."""
    from baselines.cpu_fetch import gather_gb_s

    host = torch.arange(5000 * 8, dtype=torch.float32).view(5000, 8)
    before = host.clone()
    staging = torch.zeros(3000, 8)
    gb_s = gather_gb_s(host, staging, threads=1)
    assert gb_s > 0 and torch.equal(host, before)
    rows = (staging[:, 0] / 8).long()
    assert torch.equal(staging, host[rows])  # every staged row is a whole host row
    assert rows.unique().numel() > 2000  # random rows, not one repeated
    idx = torch.tensor([4999, 7, 7, 0])  # a step's own indices: exactly those rows, in order
    assert gather_gb_s(host, staging, threads=1, idx=idx) > 0
    assert torch.equal(staging[:4], host[idx])
    layers = [host, host + 1.0, host + 2.0]  # a pass reads every layer's store in turn: the last one's rows remain
    assert gather_gb_s(layers, staging, threads=1, idx=idx, repeats=1) > 0
    assert torch.equal(staging[:4], layers[2][idx])


def test_infinigen_gather_threads_follow_the_fetch_size():
    # the gather is memory-bound: half the cores stepped fastest for small fetches and at BSZ 1, every core for the
    # larger fetches of BSZ > 1 and for BSZ 1's largest
    big = ALL_CORES_FETCH_BYTES + 1
    assert gather_threads(16, ALL_CORES_FETCH_BYTES, 8) == 8 and gather_threads(16, big, 2) == 16
    assert gather_threads(16, ALL_CORES_FETCH_BYTES_BSZ1, 1) == 8
    assert gather_threads(16, ALL_CORES_FETCH_BYTES_BSZ1 + 1, 1) == 16
    assert gather_threads(1, 1, 1) == 1
    ig = InfiniGen(cpu_threads=1)
    assert ig.cpu_threads == 1 and not ig.auto_threads  # an explicit count is kept
