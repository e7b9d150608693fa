"""A decode step's phases from its Chrome trace (`trace_dir=` of the run command), as the run's record keeps them
(`trace_phase_ms`): the compute stream's time split into its kernels' phases and its idle gaps charged to what it
waited for (experiments/runner/trace_phases.py says how).

    python -m experiments.traces.step_phases results/.../decode_step.trace.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments.runner.trace_phases import load_events, step_phases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path)
    args = ap.parse_args()
    print(json.dumps(step_phases(load_events(args.trace)), indent=1))


if __name__ == "__main__":
    main()
