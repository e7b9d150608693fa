"""One CLO decode layer at Llama-3-8B shape (BSZ 1, 128K, top-k 10%), part by part, each replayed from a CUDA
graph and reported next to its physical floor (paper Figure 11's breakdown).

The layer's KV is synthetic (random K/V); its persistent/prefetch heads are the plan the runner would make for
that layer (DuoAttention importance, the llama3-from-smollm2 reuse profile, the measured layer time and link).
Hit rates are forced, not simulated: 'all miss' moves every cached head's top-k rows (the worst step), 'all
hit' only the prefetch heads' (they are refreshed every step by design), and scores only them and the
persistent heads (a cached head that hits is neither scored nor selected; its floor counts only their
metadata). The parts:

  dense        norms, projections, MLP (the model's work; T_comp), and the next layer's speculative query
  lookup       fused lookup + label update          retrieval  hash scores + top-k of the cached heads
  transfer     UVA gather of the missed rows        persistent top-k of the persistent heads (read in place)
  attention    hybrid attention over window + selected rows
  side         lookup + retrieval + transfer, one after the other on one stream (the one-layer-ahead work)
  layer        that work on CLO's side and copy streams, overlapped with persistent + attention + dense, as a
               decode step runs them
  pipeline     --pipeline-layers consecutive sparse layers in a step's order (prepare l + 1, decode l, dense), per
               layer, for both persist_query modes: the layer time inside a step, next to its floor

    python -m experiments.bench.bench_clo_layer --out results/bench/clo_layer.json [--seqlen 131072] [--layer 5]
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from unittest.mock import patch  # a setting changed for one block, restored after

import torch
import torch.nn.functional as F

from clo.config import PERSIST_QUERIES
from clo.system import CLO
from experiments.bench.clo_pipeline import CASES, forced, pipeline_step, pipeline_variants
from experiments.bench.common import DEV, LLAMA3, UVA_PROGRAMS, kernel_timeline
from experiments.runner import timing
from experiments.runner.records import environment
from experiments.runner.timing import copy_bandwidth_gb_s, dense_work, layer_time_s, pinned_h2d_gb_s, replay_ms
from kvoffload.kernels import radix_topk
from kvoffload.kernels.decode_attention import decode_attention_triton
from kvoffload.kernels.dense_ops import silu_mul
from kvoffload.kernels.gemv import linear, linear_pair, linear_silu_mul
from kvoffload.kernels.head_cache import lookup_and_update
from kvoffload.kv.interface import KVSpec
from kvoffload.kv.timer import PhaseTimer
from kvoffload.model.decoder import Layer
from kvoffload.paths import ROOT, write_json_atomic


def build(
    seqlen: int,
    layers: list[int],
    persist_query: str = "real",
    layer_time_ms: float | None = None,
    link_gb_s: float | None = None,
) -> tuple[CLO, Layer]:
    cfg = LLAMA3
    dense = Layer(cfg).to(DEV, torch.bfloat16)

    spec = KVSpec(
        cfg.num_layers,
        1,
        seqlen + 16,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        torch.bfloat16,
        DEV,
        layer_time_s=layer_time_s(dense, 1),
        link_gb_s=timing.link_gb_s(DEV),
    )
    clo = CLO(
        importance="Llama-3-8B-Instruct-Gradient-1048k",
        profile=str(ROOT / "data/profiles/llama3-from-smollm2.json"),
        persist_query=persist_query,
        layer_time_ms=layer_time_ms,
        link_gb_s=link_gb_s,
    )
    clo.allocate(spec, PhaseTimer(DEV, enabled=False))
    k, v = (torch.randn(1, cfg.num_kv_heads, seqlen, cfg.head_dim, dtype=torch.bfloat16, device=DEV) for _ in "kv")
    for layer in layers:  # the same random KV in each: only the plans differ
        clo.prefill(layer, k, v)
    clo.end_prefill(seqlen)
    clo.begin_step()  # the step's position and window lengths
    return clo, dense


def measure(clo: CLO, dense: Layer, layer: int, uva_programs: list[int], trace: Path | None = None) -> dict:
    st = clo.stores[layer]
    d, hkv, g = LLAMA3.head_dim, LLAMA3.num_kv_heads, LLAMA3.group_size
    q = torch.randn(1, hkv * g, d, dtype=torch.bfloat16, device=DEV)
    qp = st.permute_q(q)
    qc = qp.view(1, -1, g, d)[:, : st.nc]
    idx = st.retrieve(clo.retriever, layer, qp, st.cached)
    all_miss = torch.ones(1, st.nc, dtype=torch.bool, device=DEV)
    persist_idx = st.select_persistent(qp, clo.retriever, layer)
    dense_step = dense_work(dense, 1, True)

    def main_work():  # what the compute stream does while the side stream prepares the next layer, in a decode
        # step's order: attention (after the persistent heads' top-k with persist_query=real; with speculative,
        # their rows were selected one layer ahead), then the dense work
        clo.attend(layer, q, persist_idx if clo.cfg.persist_query == "speculative" else None)
        dense_step()

    def layer_work():  # CLO.prepare's streams: lookups and retrieval on side, the gather on copy behind them
        # (here the gather refills the slots this same layer's attention reads: a race in the values, harmless to
        # the timing, which is all this measures; in decode the gather fills the next layer's slots)
        clo.ahead(layer, q)
        main_work()
        torch.cuda.current_stream().wait_stream(clo.copy)

    def timed(fn):
        return round(replay_ms(fn, reps=10) * 1e3, 1)

    def layer_parts() -> dict:  # the parts that depend on the top-k and the gather's grid
        out = {
            "retrieval": timed(lambda: st.retrieve(clo.retriever, layer, qp, st.cached)),
            "transfer": timed(lambda: clo.transfer.fill(st.host, st.cached, idx, all_miss, st.slots)),
            "persistent": timed(lambda: st.select_persistent(qp, clo.retriever, layer)),
        }
        for case in CASES:
            out[f"side_{case}"] = forced(st, case, lambda: timed(lambda: clo.refresh(layer, qp)))
            out[f"layer_{case}"] = forced(st, case, lambda: timed(layer_work))
        return out

    scores = clo.retriever.scores(layer, qp, st.cached)
    out = {
        "dense": timed(dense_step),
        "dense.gemvs": timed(gemvs(dense)),  # its projections alone: the rest is norms, RoPE and additions
        "dense.gemvs_cublas": timed(gemvs(dense, cublas=True)),
        "lookup": timed(
            lambda: lookup_and_update(qc, st.labels, st.valid, st.tau, st.weights, st.prefetch_mask, "mean")
        ),
        "attention": timed(lambda: st.attend(q, clo.win_len, persist_idx)),  # one launch, every head
        "persistent_and_attention": timed(lambda: clo.attend(layer, q, None)),  # as decode runs them
        "transfer_no_miss": timed(lambda: clo.transfer.fill(st.host, st.cached, idx, ~all_miss, st.slots)),
        # the retrieval's own parts, to see which one the layer waits for
        "retrieval.encode_query": timed(lambda: clo.retriever.encode_query(layer, qp, st.cached)),
        "retrieval.scores": timed(lambda: clo.retriever.scores(layer, qp, st.cached)),
        "retrieval.topk_torch": timed(lambda: radix_topk.topk_ref(scores, st.k)),
        "retrieval.topk_radix": timed(lambda: radix_topk.topk_indices(scores, st.k)),
        **layer_parts(),
    }
    # the variants the defaults were chosen from: torch.topk, and caps on the UVA gather's grid
    variants = {}
    with patch.object(st, "topk", "torch"):
        variants["torch_topk"] = layer_parts()
    for mode in PERSIST_QUERIES:  # the persistent heads' top-k on the critical path, or one layer ahead
        with patch.object(clo, "cfg", replace(clo.cfg, persist_query=mode)):
            variants[f"persist_query_{mode}"] = layer_parts()
    for cap in uva_programs:
        with patch.object(clo.transfer, "uva_programs", cap):
            variants[f"uva_programs_{cap}"] = layer_parts()
    for warps in (1, 2):  # a lighter gather leaves more of each SM it shares to the dense GEMVs
        with patch.object(clo.transfer, "uva_warps", warps):
            variants[f"uva_warps_{warps}"] = layer_parts()
    out["variants"] = variants
    out["attention_variants"] = attention_variants(st, q, clo.win_len, persist_idx, timed)
    if trace is not None:
        trace.mkdir(parents=True, exist_ok=True)
        for case in CASES:
            out[f"timeline_{case}"] = forced(
                st, case, lambda: kernel_timeline(layer_work, trace / f"layer_{case}.trace.json")
            )
    return out


def attention_variants(st, q, win_len, persist_idx, timed) -> dict:
    """The hybrid attention's launch parameters (rows per block, warps, programs per buffer): which the defaults
    (64, 4, 512) should be for CLO's buffers."""
    window, slots = st.buffers(win_len)
    indexed = st.persist_rows(persist_idx)
    return {
        f"{bn}/{w}/{p}": timed(
            lambda: decode_attention_triton(
                q, *window, bn, w, second=slots, indexed=indexed, q_heads=st.order, programs=p
            )
        )
        for bn in (32, 64, 128)
        for w in (2, 4, 8)
        for p in (256, 512, 1024)
    }


def gemvs(layer: Layer, cublas: bool = False):
    """A closure running only a decode step's projections of `layer` (q/k/v, o, gate/up with the SiLU-multiply,
    down, the speculative q) with the decoder's GEMV kernels, or with cuBLAS (F.linear, then the SiLU-multiply)."""
    p = layer.input_layernorm.weight
    a, m = layer.self_attn, layer.mlp
    x = torch.randn(1, 1, p.shape[0], device=p.device, dtype=p.dtype)
    inter = torch.randn(1, 1, m.down_proj.in_features, device=p.device, dtype=p.dtype)
    one, gated = (F.linear, lambda x, w: silu_mul(F.linear(x, w))) if cublas else (linear, linear_silu_mul)
    w_q = a.query_weights()[0]
    # ours: the speculative q and q/k/v into one buffer, as the decoder makes them (linear_pair)
    pair = (
        (lambda: (one(x, w_q), one(x, a.qkv_proj.weight)))
        if cublas
        else (lambda: linear_pair(x, w_q, None, x, a.qkv_proj.weight, None))
    )
    return lambda: (pair(), one(x, a.o_proj.weight), gated(x, m.gate_up_proj.weight), one(inter, m.down_proj.weight))


def floors(clo: CLO, dense: Layer, layer: int, hbm: float, link: float) -> dict:
    """The layer's physical floors; hbm and link in bytes per microsecond."""
    st = clo.stores[layer]
    row = 2 * LLAMA3.head_dim * 2
    n_persist = st.window.shape[1] - st.nc
    weights = sum(p.numel() * p.element_size() for p in dense.parameters())
    meta = clo.retriever.metadata_bytes() / max(sum(s is not None for s in clo.stores), 1)
    attended = st.window.shape[1] * (st.sink + st.recent + 1 + st.k) * row
    return {
        "transfer_bytes_all_miss": st.nc * st.k * row,
        "link_gb_s": round(link / 1e3, 1),
        "transfer_floor_all_hit_us": round(int(st.prefetch_mask.sum()) * st.k * row / link, 1),
        "hbm_gb_s": round(hbm / 1e3, 1),
        "transfer_floor_us": round(st.nc * st.k * row / link, 1),
        "dense_floor_us": round(weights / hbm, 1),
        # CLO's one-layer-ahead query reads the next layer's W_Q a second time in every step
        "speculative_query_floor_us": round(LLAMA3.num_heads * LLAMA3.head_dim * LLAMA3.hidden_size * 2 / hbm, 1),
        "retrieval_floor_us": round(meta / hbm, 1),
        # every head hitting, only the persistent and prefetch heads are scored (a hit reuses its rows)
        "retrieval_floor_all_hit_us": round(
            meta * (n_persist + int(st.prefetch_mask.sum())) / st.window.shape[1] / hbm, 1
        ),
        "attention_floor_us": round(attended / hbm, 1),
        "cached_heads": st.nc,
        "persistent_heads": n_persist,
        "prefetch_heads": int(st.prefetch_mask.sum()),
        "k": st.k,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seqlen", type=int, default=131072)
    ap.add_argument("--layer", type=int, default=5, help="a layer with the median number of persistent heads")
    ap.add_argument("--trace", type=Path, help="also write Chrome traces of the layer (all miss, all hit) here")
    ap.add_argument(
        "--uva-programs",
        type=int,
        nargs="*",
        default=list(UVA_PROGRAMS),
        help="caps on the UVA gather's grid to compare (100000: one program per tile of a head)",
    )
    ap.add_argument(
        "--persist-query",
        choices=PERSIST_QUERIES,
        default="real",
        help="CLO's persist_query for the main parts and the timelines (the variants measure both)",
    )
    ap.add_argument(
        "--pipeline-layers",
        type=int,
        default=8,
        help="consecutive sparse layers from --layer on for the step-order pipeline (0: skip it)",
    )
    ap.add_argument("--layer-time-ms", type=float, help="pin Eq. 12's T_comp (default: measured), e.g. to a run's plan")
    ap.add_argument("--link-gb-s", type=float, help="pin Eq. 12's link bandwidth (default: measured)")
    args = ap.parse_args()
    layers = list(range(args.layer, args.layer + max(args.pipeline_layers, 1)))
    clo, dense = build(args.seqlen, layers, args.persist_query, args.layer_time_ms, args.link_gb_s)
    hbm, link = copy_bandwidth_gb_s(DEV) * 1e3, pinned_h2d_gb_s(DEV) * 1e3  # bytes per microsecond
    us, fl = measure(clo, dense, args.layer, args.uva_programs, args.trace), floors(clo, dense, args.layer, hbm, link)
    for parts in (us, *us["variants"].values()):
        for case in CASES:
            parts[f"layer_{case}_over_floor"] = round(parts[f"layer_{case}"] / own_floor(fl, case), 2)
    print(
        "\n".join(f"{k:>24} {v}" for k, v in {**us, **fl}.items() if k != "variants" and not k.startswith("timeline"))
    )
    for name, parts in us["variants"].items():
        print(f"{name:>24} " + " ".join(f"{k}={v}" for k, v in parts.items()))
    pipeline = None
    if args.pipeline_layers > 1:
        per_layer = [floors(clo, dense, i, hbm, link) for i in layers]
        # pipelined, the link and HBM work of all the layers overlap: the floor is the larger of the two sums
        floor = {
            case: round(
                max(sum(own_floor(f, case, part) for f in per_layer) for part in ("hbm", "link")) / len(layers), 1
            )
            for case in CASES
        }
        res = pipeline_variants(clo, dense, layers)
        for key in list(res):
            case = next((c for c in CASES if key.endswith(c)), None)
            if case is not None:
                res[f"{key}_over_floor"] = round(res[key] / floor[case], 2)
        pipeline = {"layers": layers, "floor_us": floor, "us": res}
        if args.trace is not None:  # all hit, this run's persist_query
            pipeline["timeline_all_hit"] = forced(
                [clo.stores[i] for i in layers],
                "all_hit",
                lambda: kernel_timeline(
                    pipeline_step(clo, dense_work(dense, 1, True), layers), args.trace / "pipeline_all_hit.trace.json"
                ),
            )
        print(f"{'pipeline':>24} " + " ".join(f"{k}={v}" for k, v in res.items()))
    write_json_atomic(
        args.out,
        {
            "bench": "clo_layer",
            "seqlen": args.seqlen,
            "layer": args.layer,
            "persist_query": args.persist_query,
            "weights": "synthetic (random K/V, random layer weights)",
            "us": us,
            "floors": fl,
            "pipeline": pipeline,
            "plan": clo.plan.heads.summary(),
            "environment": environment(DEV),
        },
    )


def own_floor(fl: dict, case: str, part: str = "both") -> float:
    """A layer's own floor for a case: HBM (weights + metadata + attended rows) vs the link (the moved rows)."""
    retrieval = fl["retrieval_floor_us"] if case == "all_miss" else fl["retrieval_floor_all_hit_us"]
    hbm = fl["dense_floor_us"] + fl["speculative_query_floor_us"] + retrieval + fl["attention_floor_us"]
    link = fl["transfer_floor_us"] if case == "all_miss" else fl["transfer_floor_all_hit_us"]
    return {"hbm": hbm, "link": link, "both": max(hbm, link)}[part]


if __name__ == "__main__":
    main()
