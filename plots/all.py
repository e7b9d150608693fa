"""Rebuild every figure and table that has records under the results folder, PNG and PDF, the paper's numbers
beside ours wherever it gives them. One line per figure: ok (its records and commit), `no records yet: <folder>`
(its producer has not run), or failed (why: mixed commits, an unknown system...); the others are still drawn,
and the exit status is 1 if any failed. Beside each figure drawn, <name>.caption.md: what it shows and the
commit of each record it was drawn from (a figure's titles name none). A results folder that does not exist is
refused (exit 2). It reads a results/-style tree, each figure from its own folder (FIGURES below:
fig10_throughput/, tab4_hit_rate/, ...); a sweep's own folder is drawn by that figure's module, e.g.
`python -m plots.fig10_throughput <folder> --out fig10`.

    python -m plots.all [--results results] [--out results/figures]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from plots import (
    ablation,
    fidelity,
    fidelity_frontier,
    fig2_breakdown,
    fig3_13_link,
    fig4_6_similarity,
    fig10_prefill,
    fig10_throughput,
    phase_breakdown,
    tab4_hit_rate,
    tab4_hit_rate_batch,
    tab5_ablation,
    tab5_accuracy,
    tab6_memory,
)
from plots.records import NoRecords, RecordError, cli, commit_of, find, fit_refusal, load_files

REFUSED = "refused before running (the preflight's estimate: no run, no commit)"


@dataclass(frozen=True)
class Figure:
    name: str  # the output's stem
    folder: str  # under the results folder
    plot: Callable
    what: str
    options: dict = field(default_factory=dict)

    @property
    def folders(self) -> list[str]:
        """The results folders it draws: its own, and the CPU records a speed-vs-fidelity figure pairs with it."""
        return [self.folder, *([self.options["cpu"]] if "cpu" in self.options else [])]


FIGURES = (
    Figure("fig2_breakdown", "fig2_breakdown_128k", fig2_breakdown.plot, "paper Fig. 2: per-layer latency by phase"),
    Figure(
        "fig2_breakdown_qwen25",
        "fig2_breakdown_128k_qwen25",
        fig2_breakdown.plot,
        "paper Fig. 2 at Qwen2.5-14B shapes (paper Fig. 11's model)",
    ),
    Figure(
        "fig2_breakdown_fitted_queries",
        "investigations/synthetic_workload_check/fig2_128k_de575a6",
        fig2_breakdown.plot,
        "paper Fig. 2 under the fitted persistent + AR(1) query process",
    ),
    Figure(
        "fig2_breakdown_fair_baselines",
        "fair_baselines_128k",
        fig2_breakdown.plot,
        "paper Fig. 2 with the native-speed baselines, fitted query process",
    ),
    Figure("ablation_gpu", "ablation_gpu_128k", ablation.plot, "the +T/+G/+P ablation, latency (GPU)"),
    Figure("ablation_cpu", "ablation_cpu", ablation.plot, "the +T/+G/+P ablation, hit rate and bytes (CPU)"),
    Figure("tab4_hit_rate", "tab4_hit_rate", tab4_hit_rate.plot, "paper Tab. 4: cache hit rate"),
    Figure(
        "tab4_hit_rate_batch",
        "fig10_throughput",
        tab4_hit_rate_batch.plot,
        "paper Tab. 4 by batch, from Figure 10's runs",
        {"allow_mixed": True},
    ),
    Figure("tab6_memory", "tab6_memory", tab6_memory.plot, "paper Tab. 6: device memory of the KV state"),
    Figure("fig4_6_similarity", "fig4_6_similarity_smollm2", fig4_6_similarity.plot, "paper Fig. 4-6: query reuse"),
    Figure("fig3_13_link", "fig3_13_link", fig3_13_link.plot, "paper Fig. 3/13: link bandwidth"),
    Figure(
        "fig10_throughput",
        "fig10_throughput",
        fig10_throughput.plot,
        "paper Fig. 10: throughput",
        {"allow_mixed": True},
    ),
    Figure(
        "fig10_throughput_nobudget",
        "fig10_throughput_nobudget",
        fig10_throughput.plot,
        "paper Fig. 10's grid without a device budget (H100)",
        {"allow_mixed": True},
    ),
    Figure(
        "fig10_prefill",
        "fig10_prefill",
        fig10_prefill.plot,
        "paper Fig. 10: prefill throughput, real prefills (two cards, each point's named)",
        {"allow_mixed": True},
    ),
    Figure(
        "fig10_beyond",
        "fig10_beyond",
        fig10_throughput.plot,
        "beyond Fig. 10: BSZ 128-256 at 1K-4K, 704K-768K at BSZ 1 (H100)",
        {"allow_mixed": True},
    ),
    Figure(
        "fig10_throughput_qwen25",
        "fig10_throughput_qwen25",
        fig10_throughput.plot,
        "paper Fig. 10: throughput, Qwen2.5-14B shapes",
        {"allow_mixed": True},
    ),
    Figure("tab5_accuracy", "tab5_accuracy", tab5_accuracy.plot, "paper Tab. 5: accuracy"),
    Figure("tab5_ablation", "tab5_ablation", tab5_ablation.plot, "Tab. 5 ablations: CLO's retriever and eta"),
    Figure("fidelity", "fidelity", fidelity.plot, "fidelity against exact attention (SmolLM2, CPU)"),
    Figure(
        "fidelity_frontier_128k_b1",
        "fidelity_frontier/128k_b1",
        fidelity_frontier.plot_results,
        "speed vs fidelity: Llama-3 shapes at 128K BSZ 1 (GPU), SmolLM2 on 2K documents (CPU)",
        {"cpu": "fidelity/2k"},
    ),
    Figure(
        "fidelity_frontier_32k_b8",
        "fidelity_frontier/32k_b8",
        fidelity_frontier.plot_results,
        "speed vs fidelity: Llama-3 shapes at 32K BSZ 8 (GPU), SmolLM2 on 2K documents (CPU)",
        {"cpu": "fidelity/2k"},
    ),
    Figure("phases_gpu_smoke_eager", "gpu_smoke_llama3/eager", phase_breakdown.plot, "FullAttn smoke runs, eager"),
    Figure(
        "phases_gpu_smoke_graph",
        "gpu_smoke_llama3/graph",
        phase_breakdown.plot,
        "FullAttn smoke runs, graph (two commits, each bar's in the caption; its README says why)",
        {"allow_mixed": True},
    ),
    Figure(
        "phases_clo_gpu",
        "clo_gpu",
        phase_breakdown.plot,
        "CLO vs FullAttn, 32K-512K (several commits, each bar's in the caption; its README says which)",
        {"allow_mixed": True},
    ),
    Figure(
        "phases_baselines_topk",
        "investigations/baselines_topk_ab_128k",
        phase_breakdown.plot,
        "baselines' top-k, torch vs radix",
    ),
)


def commits_of(folder: Path) -> str:
    try:
        return load_files(folder, "*.json", lambda r: "environment" in r, allow_mixed=True).commit
    except RecordError:
        return "?"


def drawn_record(rec: dict) -> bool:
    """A record a figure draws: a finished run or a benchmark's rows (not a crash), stamped with its commit."""
    return "environment" in rec and rec.get("status", "ok") == "ok"


def files_by_commit(folder: Path) -> dict[str, list[str]]:
    """commit -> the files of folder's drawn records made at it; the preflight's refusals (nothing ran, so no
    commit) under 'refused before running'."""
    by: dict[str, list[str]] = {}
    for r in find(folder, "*.json", lambda r: drawn_record(r) or fit_refusal(r), "records"):
        key = (commit_of(r["record"]) or "no commit") if drawn_record(r["record"]) else REFUSED
        by.setdefault(key, []).append(r["file"])
    return dict(sorted(by.items(), key=lambda kv: (kv[0] == REFUSED, kv[0])))


def caption(f: Figure, results: Path) -> str:
    """The caption written beside a figure: what it is, and the commit of every record it was drawn from. The
    figure's own titles name no commit (save refuses them): a reader of a paper needs what, not where."""
    lines = [f"**{f.name}**: {f.what}.", "", "Drawn by `python -m plots.all` from these records:"]
    for folder in f.folders:
        readme = " (its README.md says how they were made)" if (results / folder / "README.md").exists() else ""
        lines += ["", f"`{results.name}/{folder}/`{readme}:"]
        for commit, files in files_by_commit(results / folder).items():
            head = commit if commit == REFUSED else f"commit {commit}"
            lines.append(f"- {head}, {len(files)} file(s): " + ", ".join(f"`{x}`" for x in files))
    return "\n".join(lines) + "\n"


def build(results: Path, out: Path, figures=FIGURES, log=print) -> dict[str, str]:
    """Draws each figure whose folder has records; returns name -> 'ok' | 'no records' | 'failed: <why>'."""
    status = {}
    for f in figures:
        folder = results / f.folder
        try:
            f.plot(folder, out / f.name, **f.options)
        except NoRecords:
            status[f.name] = "no records"
            log(f"no records yet: {folder}")
        except (RecordError, KeyError, TypeError, ValueError) as e:  # a record without a field a figure reads
            why = str(e) if isinstance(e, RecordError) else f"{type(e).__name__}: {e} (a record lacks a field?)"
            status[f.name] = f"failed: {why}"
            log(f"failed: {f.name} ({folder}): {why}")
        else:
            status[f.name] = "ok"
            (out / f"{f.name}.caption.md").write_text(caption(f, results))
            mixed = ", each file's in its caption" if f.options.get("allow_mixed") else ""
            log(f"ok: {f.name} <- {folder} (commit {commits_of(folder)}{mixed}) -> {out / f.name}.png, .pdf")
    return status


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=Path("results"), help="a results/-style tree of figure folders")
    ap.add_argument("--out", type=Path, default=Path("results/figures"))
    args = ap.parse_args(argv)
    if not args.results.is_dir():
        raise NoRecords(f"no results folder {args.results}")
    status = build(args.results, args.out)
    if all(s == "no records" for s in status.values()):
        raise NoRecords(
            f"no figure has records under {args.results}: it reads a results/-style tree of figure folders; draw a "
            "sweep's folder with its figure's module (python -m plots.fig10_throughput <folder>)"
        )
    if any(s.startswith("failed") for s in status.values()):
        sys.exit(1)


if __name__ == "__main__":
    cli(main)
