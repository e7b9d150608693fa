"""What a run decodes: its prompts (`prompts.py`) and the synthetic query and key processes fitted to real
models' profiles (`query_process.py`, `key_process.py`, each with a command that fits its profile)."""
