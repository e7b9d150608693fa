#!/usr/bin/env bash
# The Triton kernels against their torch references on a machine without a GPU, in Triton's interpreter:
#   bash scripts/interpret_kernels.sh [pytest arguments, e.g. -k uva]
# The suite skips these tests (.venv has no triton); .ci/run runs this script after it (about 2 minutes). The first
# run installs triton and a numpy whose integers the interpreter's loop bounds accept (2.4 refuses them) into a
# folder of their own, not into .venv, so the project's own environment is left as install.sh made it.
set -euo pipefail
cd "$(dirname "$0")/.."
site=${INTERPRET_SITE:-${TMPDIR:-/tmp}/clo-interpret-site}
if [[ ! -d "$site/triton" ]]; then
  .venv/bin/python -m pip install -q --no-deps --target "$site" triton==3.6.0 numpy==2.2.6
fi
PYTHONPATH="$site" TRITON_INTERPRET=1 exec .venv/bin/python -m pytest -q -p no:cacheprovider \
  tests/test_clo_kernels.py tests/test_clo_select_kernels.py tests/test_kernels.py tests/test_dense_ops.py \
  tests/test_gemv.py tests/test_fp8_kernels.py "$@"
