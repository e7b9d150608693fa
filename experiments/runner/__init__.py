"""The run command's library (`python -m experiments.run`): the run itself, its checks before measuring, its
records, timing, the job processes and GPU assignment of a sweep, its W&B log. No entry points here."""
