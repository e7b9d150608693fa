"""A W&B Report of one comparison, from what experiments.runner.wandb_log logs for each run: decode ms/step by system,
the per-phase breakdown (the summary's phase_ms/* as bars, and the runs' phase_breakdown tables), and the cache hit
rate. One report per W&B group (an experiment bundle, e.g. fig2_breakdown):

    python -m experiments.tracking.wandb_report --project clo-kv-offload --group fig2_breakdown [--entity E]

Saving needs the W&B server, so it runs only with WANDB_API_KEY set (offline runs: `wandb sync` them first);
without it the command says so in one line and exits 2. Needs the `report` extra (wandb-workspaces)."""

from __future__ import annotations

import argparse
import os
import sys

from kvoffload.kv.timer import PHASES

# How the runs of a group are told apart: experiments.runner.wandb_log logs the system's name as config key `system`.
BY_SYSTEM = "system"


def build_report(project: str, group: str, entity: str, title: str | None = None):
    """The report object (not saved): a runset of the group's runs and one grid of panels, each grouped by system
    (several runs of one system, e.g. two needle depths, are averaged; the bars show their min-max)."""
    import wandb_workspaces.reports.v2 as wr
    from wandb_workspaces import expr

    def bars(title: str, metrics: list[str]):
        return wr.BarPlot(
            title=title,
            metrics=[wr.SummaryMetric(m) for m in metrics],
            groupby=wr.Config(BY_SYSTEM),
            groupby_aggfunc="mean",
            groupby_rangefunc="minmax",
            orientation="v",
            layout=wr.Layout(w=12, h=8),
        )

    runs = wr.Runset(entity=entity, project=project, name=group, filters=expr.And(expr.Metric("Group") == group))
    panels = [
        bars("Decode ms/step by system", ["decode_ms_per_step"]),
        bars("Where a decode step's time goes (ms/step by phase)", [f"phase_ms/{p}" for p in PHASES]),
        bars("Cache hit rate by system", ["hit_rate"]),
        wr.WeavePanelSummaryTable(table_name="phase_breakdown", layout=wr.Layout(w=12, h=8)),
    ]
    return wr.Report(
        project=project,
        entity=entity,
        title=title or f"{group}: decode latency by system",
        description=f"Runs of W&B group {group!r}, logged by python -m experiments.run "
        "(experiments/runner/wandb_log.py).",
        blocks=[
            wr.P(
                f"Each bar is a system's mean over its runs in group {group!r} (min-max whiskers). The phases are"
                f" {', '.join(PHASES)}; 'other' is the step minus the named phases (the dense layers). A system in"
                " CUDA-graph decode is timed whole: its phases are not split. Hit rate is empty for systems without"
                " a cache (FullAttn)."
            ),
            wr.PanelGrid(runsets=[runs], panels=panels),
        ],
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.tracking.wandb_report", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--project", required=True, help="W&B project (experiments.run's wandb.project)")
    ap.add_argument("--group", required=True, help="W&B group: the experiment bundle, e.g. fig2_breakdown")
    ap.add_argument("--entity", default=None, help="W&B entity (default: the API key's default entity)")
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    if not os.environ.get("WANDB_API_KEY"):
        print("error: saving a W&B report needs WANDB_API_KEY (offline runs: `wandb sync` them first)", file=sys.stderr)
        return 2
    try:
        import wandb_workspaces  # noqa: F401
    except ImportError:
        print("error: the W&B report needs wandb-workspaces: pip install -e '.[report]'", file=sys.stderr)
        return 2
    if args.entity is None:
        import wandb

        args.entity = wandb.Api().default_entity
    report = build_report(args.project, args.group, args.entity, args.title)
    report.save()
    print(report.url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
