"""Microbenchmarks and kernel tuning (`bench_*.py`, `tune_*.py`) and the multi-GPU sweep comparison: each a command
writing one JSON record. What they share is in `common.py`; a bench script never imports another."""
