"""W&B after the fact: finished records logged to W&B later (`wandb_records.py`), a W&B Report of a comparison
(`wandb_report.py`). A run's own logging is the runner's (`experiments/runner/wandb_log.py`)."""
