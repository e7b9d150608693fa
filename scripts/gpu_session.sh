#!/usr/bin/env bash
# One device call that checks and measures everything GPU-side, for a session with little device time:
#   run(command="bash scripts/gpu_session.sh <commit> [stage ...]", carry=[".whl"], timeout_s=600)
# With stage names (pytest_gpu bench_clo bench_clo_layer clo_graph fig2 clo_512k ablation), only those run;
# SEQLENS=32k picks clo_graph's context lengths.
# It installs the carried wheels (hardware.md), runs the GPU tests, the kernel benchmarks and the system runs,
# and packs every record and log into $OUT/gpu_session.tgz (one file: the device returns at most 8).
# Stages are independent and time-boxed, so one failure or overrun does not lose the others' output.
set -u
commit=${1:?usage: gpu_session.sh <git commit of this working tree> [stage ...]}
shift
only=" $* "
export CLO_GIT_COMMIT=$commit PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
out=$(mktemp -d /tmp/gpu_session.XXXX)  # fresh: a machine kept warm between calls keeps /tmp, and runs skip existing records
stage() {  # stage <name> <seconds> <command...>
  local name=$1 secs=$2
  shift 2
  [[ "$only" == "  " || "$only" == *" $name "* ]] || return 0
  echo "== $name" | tee -a "$out/summary.log"
  timeout "$secs" "$@" > "$out/$name.log" 2>&1
  echo "   exit $?" | tee -a "$out/summary.log"
  grep -v '%|' "$out/$name.log" | tail -5 | tee -a "$out/summary.log"
}
(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
 python3 -c "import torch, triton, flashinfer; print(torch.__version__, triton.__version__, flashinfer.__version__)"
) > "$out/env.txt" 2>&1
stage pytest_gpu 120 python3 -m pytest -m gpu -q tests/
stage bench_clo 60 python3 -m experiments.bench_clo --out "$out/bench_clo.json"
stage bench_clo_layer 150 python3 -m experiments.bench_clo_layer --out "$out/clo_layer.json"
run="python3 -m experiments.run --multirun results_dir=$out/runs"  # hydra wants its flags first
stage clo_graph 120 $run +experiment=clo_synthetic system=clo,fullattn seqlen=${SEQLENS:-32k,128k} workload.gen_tokens=32
stage fig2 200 $run +experiment=fig2_breakdown workload.gen_tokens=16
stage ablation 200 $run +experiment=clo_synthetic system=clo +ablation=base,t,tg,tgp seqlen=128k workload.gen_tokens=16
stage clo_512k 450 $run +experiment=clo_synthetic system=clo seqlen=512k workload.gen_tokens=16  # prefill ~3 min
tar -czf "${OUT:-/tmp}/gpu_session.tgz" -C "$out" .
cp "$out/summary.log" "${OUT:-/tmp}/summary.log"
