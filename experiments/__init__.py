"""What runs experiments, one room per kind of code:

- `run.py` (`python -m experiments.run`, the Hydra run command) and `report.py` (`python -m experiments.report`,
  results/ -> results/REPORT.md): the entry points at the top;
- `runner/`: the run command's library (execute, preflight, records, timing, ...), no entry points;
- `workloads/`: what a run decodes: prompts and the synthetic query and key processes;
- `accuracy/`: lm-eval tasks through our decoder (`python -m experiments.accuracy`);
- `producers/`: measurements outside the run command (profiles, HATA weights, recall, similarity, memory table);
- `bench/`: microbenchmarks and kernel tuning, what they share in `bench/common.py`;
- `traces/`: reading a run's Chrome traces and memory snapshots;
- `tracking/`: W&B after the fact (records logged later, Reports).

The runner and the workloads import none of producers, bench, traces or tracking (pyproject.toml's contracts)."""
