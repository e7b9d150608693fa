"""The generated blocks of results/bench/README.md (plots.readmes): each benchmark's record there as its table and
the numbers its prose leans on (decode attention, CLO's mechanisms, the GEMV and retrieval kernels' tuning, and the
GPU test logs here); the CLO layer (plots.bench_layer_readme) and the host-memory benchmarks
(plots.bench_host_readme) add theirs."""

from __future__ import annotations

import re
from pathlib import Path

from plots import bench_host_readme, bench_layer_readme
from plots.markdown import md, span
from plots.readme_parts import machine, pytest_summary
from plots.records import commit_of, read_json, tokens

ATTENTION = (
    "triton (ours)",
    "flashinfer batch decode tensor cores",
    "flashinfer batch decode",
    "torch sdpa (GQA folded)",
    "flashinfer single_decode loop",
)


def bench(folder: Path, name: str) -> dict:
    return read_json(folder / f"{name}.json")


def ran(rec: dict, file: str) -> str:
    """'`file`: commit c, <machine>.' of one benchmark record."""
    return f"`{file}`: commit {commit_of(rec)}, {machine(rec)}."


def attention(folder: Path) -> str:
    rec = bench(folder, "decode_attention")
    by = {(r["length"], r["batch"], r["kernel"]): r for r in rec["rows"]}
    modes = {r["kernel"]: r["mode"] for r in rec["rows"]}
    keys = sorted({(n, b) for n, b, _ in by})
    body = [
        [tokens(n), str(b), f"{by[(n, b, ATTENTION[0])]['floor_ms'] * 1000:.0f} µs"]
        + [
            f"{by[(n, b, k)]['ms'] * 1000:.0f} µs ({by[(n, b, k)]['x_floor']:.2f}x)" if (n, b, k) in by else "-"
            for k in ATTENTION
        ]
        for n, b in keys
    ]
    head = ["tokens", "BSZ", "floor"] + [f"{k} ({modes.get(k, '-')})" for k in ATTENTION]
    ours, tc, cc = (
        [by[(n, b, k)] for n, b in keys] for k in ("triton (ours)", ATTENTION[1], "flashinfer batch decode")
    )
    gap = [abs(a["ms"] / t["ms"] - 1) * 100 for a, t in zip(ours, tc)]
    big = [r["x_floor"] for r in ours + tc if r["length"] >= 65536 or r["batch"] >= 2]
    small = [r["x_floor"] for r in ours + tc if r["length"] == keys[0][0] and r["batch"] == 1]
    slow = [c["ms"] / t["ms"] for c, t in zip(cc, tc)]
    return (
        ran(rec, "decode_attention.json")
        + f" Device copy bandwidth {rec['copy_bandwidth_gb_s']:.0f} GB/s, measured in the run.\n\n"
        + md(head, body)
        + f"\n\nOur Triton kernel and flashinfer's tensor-core batch decode are within {span(gap, '{:.0f}', ' %')} of "
        f"each other and at {span(big)}x the floor from 64K tokens or BSZ 2 on; at BSZ 1, {tokens(keys[0][0])} "
        f"{span(small)}x. flashinfer's CUDA-core batch decode is {span(slow)}x the tensor-core one."
    )


def mechanisms(folder: Path) -> str:
    rec = bench(folder, "clo_mechanisms")
    rows: dict[int, dict[str, dict]] = {}
    for r in rec["transfer"]:
        m = re.search(r"(\d+) programs", r["path"])
        key = f"uva {m[1]}" if m else r["path"].replace(" threads", "")
        rows.setdefault(r["row_bytes"], {})[key] = r
    programs = sorted({int(k.split()[1]) for v in rows.values() for k in v if k.startswith("uva")})
    head = ["rows", "bulk GB/s"] + [f"UVA, {p} programs" for p in programs] + ["CPU gather + copy, 1 / 4 / 16 threads"]
    body = []
    for size, v in sorted(rows.items()):
        cpu = [v[f"cpu_gather {n}"] for n in (1, 4, 16)]
        body.append(
            [f"{size} B", f"{next(iter(v.values()))['bulk_gb_s']:.1f}"]
            + [f"{v[f'uva {p}']['gb_s']:.1f} ({v[f'uva {p}']['of_bulk']:.2f})" for p in programs]
            + [
                " / ".join(f"{c['gb_s']:.1f}" for c in cpu)
                + " ("
                + " / ".join(f"{c['of_bulk']:.2f}" for c in cpu)
                + ")"
            ]
        )
    exact = all(r.get("exact_rows", True) for r in rec["transfer"])
    lk, rt = rec["lookup"], rec["retrieval"]
    return (
        ran(rec, "clo_mechanisms.json")
        + f" UVA rows bit-exact against the reference gather: {'all' if exact else '**not all**'}.\n\n"
        + md(head, body)
        + f"\n\nFused lookup + label update: {lk['lookup_us']} µs = {lk['fraction_of_layer']:.2%} of one layer's dense "
        f"compute ({lk['layer_us']} µs, replayed from a graph). Hash scoring of {tokens(rt['tokens'])} tokens: "
        f"{rt['hash_score_us']} µs against a {rt['floor_us']} µs memory floor. The top-k of those scores: "
        f"`torch.topk` {rt['torch_topk_us']} µs, the radix select {rt['radix_topk_us']} µs (floor of its reads "
        f"{rt['topk_floor_us']} µs)."
    )


GEMV = {"qkv": "q/k/v", "q (speculative)": "q, speculative", "o": "o", "gate_up + silu_mul": "gate/up + SiLU-multiply"}


def gemv(folder: Path) -> str:
    rec = bench(folder, "gemv_tuning")
    by = {(r["projection"], r["kernel"]): r for r in rec["rows"] if r["kernel"] in ("cublas", "triton (default)")}
    projections = list(dict.fromkeys(p for p, _ in by))
    body = [
        [
            f"{GEMV.get(p, p)} ({by[(p, 'cublas')]['n']} x {by[(p, 'cublas')]['k']})",
            f"{by[(p, 'cublas')]['us']:.2f}",
            f"{by[(p, 'triton (default)')]['us']:.2f}",
            f"{by[(p, 'triton (default)')]['of_copy']:.2f}",
        ]
        for p in projections
    ]
    best = {}
    for r in rec["rows"]:
        if r["kernel"] != "cublas":
            best[r["projection"]] = min(best.get(r["projection"], r["us"]), r["us"])
    worst = max(by[(p, "triton (default)")]["us"] / best[p] - 1 for p in projections)
    return (
        ran(rec, "gemv_tuning.json")
        + f" Device copy of the same run: {rec['hbm_gb_s']:.0f} GB/s.\n\n"
        + md(["projection (Llama-3-8B)", "cuBLAS µs", "ours µs", "ours, of copy"], body)
        + f"\n\nThe defaults are at most {worst:.1%} slower than the sweep's fastest for each projection."
    )


def retrieval(folder: Path) -> str:
    rec = bench(folder, "retrieval_tuning")
    rows = rec["rows"]

    def us(kernel: str, heads: int, **kw) -> list[dict]:
        return [
            r
            for r in rows
            if r["kernel"] == kernel and r["heads"] == heads and all(r.get(k) == v for k, v in kw.items())
        ]

    enc = us("encode_query", 6)
    hs = us("hash_scores", 6, num_warps=4)
    rx = {w: us("radix_topk", 6, num_warps=w) for w in (4, 8)}
    fused = {
        h: {r["first_pass_counted"]: r["us"] for r in us("hash_scores + radix_topk", h, block_t=256)} for h in (6, 2)
    }
    order = {
        s: (us("radix_topk + sort", 8, select=s)[0]["us"], min(r["us"] for r in us("radix_topk ordered", 8, select=s)))
        for s in ("blocks", "tokens")
    }
    bf16 = [r["us"] for r in rows if "bf16" in r["kernel"]]
    j = lambda xs, key: " / ".join(str(r[key]) for r in xs)
    v = lambda xs: " / ".join(f"{r['us']:.2f}" for r in xs)
    body = [
        [f"query encoding, head_dim per step {j(enc, 'chunk')}", v(enc)],
        [f"hash scores, tokens per program {j(hs, 'block_t')} (4 warps)", f"{v(hs)} (floor {hs[0]['floor_us']})"],
        [
            f"radix top-k, keys per program {j(rx[4], 'block')}",
            "; ".join(f"{w} warps: {v(x)}" for w, x in rx.items()),
        ],
        [
            "hash scores + radix top-k, first pass counted by the scores' kernel / by its own",
            "; ".join(f"{h} heads: {f[True]:.2f} / {f[False]:.2f}" for h, f in fused.items()),
        ],
        [
            "the baselines' ascending select (8 rows), radix + sort vs the ordered radix select (best)",
            "; ".join(f"{s}: {a:.1f} vs {b:.1f}" for s, (a, b) in order.items()),
        ],
        [
            "InfiniGen-style's bf16 scores, torch.topk + sort vs the ordered radix select",
            " vs ".join(f"{x:.1f}" for x in bf16),
        ],
    ]
    return (
        ran(rec, "retrieval_tuning.json")
        + f" {tokens(rec['seqlen'])}, k = {rec['k']}, rbit {rec['rbit']}.\n\n"
        + md(["kernel", "variants (µs, 6 heads unless named)"], body)
    )


def tests(folder: Path) -> str:
    return "\n".join(f"- `{p.name}`: {pytest_summary(p)}" for p in sorted(folder.glob("pytest_*.log")))


def blocks(folder: Path) -> dict[str, str]:
    return {
        "attention": attention(folder),
        "mechanisms": mechanisms(folder),
        **bench_layer_readme.blocks(folder),
        "gemv": gemv(folder),
        "retrieval": retrieval(folder),
        "tests": tests(folder),
        **bench_host_readme.blocks(folder),
    }
