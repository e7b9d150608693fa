"""The figures plots.all draws, each from its own folder of a results/-style tree: its plot() and, beside it in the
same module, its table() (REPORT.md and the results READMEs)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class Figure:
    name: str  # the output's stem
    folder: str  # under the results folder
    plot: Callable
    what: str
    options: dict = field(default_factory=dict)

    @property
    def table(self) -> Callable | None:
        """Its table (REPORT.md, the READMEs): table(records folder, its name) beside plot() in the plot's module;
        None for a figure whose module has none (a phase breakdown)."""
        return getattr(sys.modules[self.plot.__module__], "table", None)

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
    Figure(
        "tab6_memory_link21",
        "tab6_memory_link21",
        tab6_memory.plot,
        "paper Tab. 6 with CLO planned for the paper's 21.21 GB/s link",
    ),
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
