"""Token-level fidelity against exact attention (`python -m experiments.fidelity`, docs/fidelity.md)."""
