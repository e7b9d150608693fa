#!/usr/bin/env bash
# The GPU checks and measurements, in stages, for a session with little device time:
#   run(command="bash scripts/gpu_session.sh <commit> <stage ...>", carry=[".whl"], timeout_s=600)
# Stages: host_warmup (before host-bound runs) pytest_gpu (~5 min) fig3_13 link_cap pytest_link_cap (LINK_CAPS) bench_attn (FullAttn's kernels, BSZ 1-16, 32K-128K) pytest_clo_gpu (its CLO tests alone, ~1 min) pytest_gemv tune_gemv bench_clo tune bench_clo_layer (~1.5 min together)
# bench_clo_layer_speculative, clo_graph (SEQLENS=32k,128k), clo_persist_query (128K, both persist_query modes)
# memory_peak (PEAK_SYSTEM/BATCH/SEQLEN) query_process fig10 (FIG10) link_sensitivity (LINKS) fig10_beyond (FIG10B) multi_gpu (MULTI; several GPUs, ~4 min) fig10_trace (FIG10T) fig10_prefill (FIG10P) host_gather lru block_copy (~1 min each) pin_alloc (~4 min) skew_eigh (seconds) fig2 fig2_untimed (~3.5 min each) ablation (~3 min) topk_ab (~3 min) clo_512k fullattn_512k (~4 min each). Name the ones that fit one call's
# 10 minutes; with none named, all run (more than one call holds).
# It installs the carried wheels (docs/gpu.md), runs the GPU tests, the kernel benchmarks and the system runs,
# and packs every record and log into $OUT/gpu_session.tgz (one file: the device returns at most 8).
# Stages are independent and time-boxed, so one failure or overrun does not lose the others' output.
set -u
commit=${1:?usage: gpu_session.sh <git commit of this working tree> [stage ...]}
shift
only=" $* "
export CLO_GIT_COMMIT=$commit PYTHONUNBUFFERED=1
# the records' dirty flag reads the carried manifest of the commit's code files (scripts/tree_manifest.py)
[[ -f .tree_manifest.json ]] || echo "no .tree_manifest.json carried: the records will not know if the tree is $commit's"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
mkdir -p "${OUT:-/tmp}"  # OUT=$OUT/b: a second sweep's packed output beside the first's
# SWEEP names this sweep's session folder (default "main"; a second sweep in the same call takes another name, as
# it takes OUT=$OUT/b), so that RESUME=warm finds the right one
tmp=${GPU_SESSION_TMP:-/tmp} sweep=${SWEEP:-main}
[[ "$sweep" =~ ^[A-Za-z0-9_-]+$ ]] || { echo "error: SWEEP=$sweep: letters, digits, _ and - only" >&2; exit 2; }
# the newest earlier session folder of this sweep on this machine (a machine kept warm between calls keeps /tmp)
last=$(ls -td "$tmp/gpu_session.$sweep".*/runs 2>/dev/null | head -1)
out=$(mktemp -d "$tmp/gpu_session.$sweep.XXXX")  # fresh: runs skip existing records
# RESUME=<folder>: an earlier call's runs/ (from its gpu_session.tgz, in a git-ignored folder the call carries); its
# records of this commit are copied in, so a sweep cut short by that call's 10 minutes goes on where it stopped.
# RESUME=warm: the runs/ of this machine's last call of the same SWEEP, while the machine is still the one that made
# it (it stays warm a short while between calls); on a fresh machine nothing is resumed
if [[ "${RESUME:-}" == warm ]]; then
  RESUME=$last
  [[ -n "$RESUME" ]] || echo "RESUME=warm: no earlier call's runs of SWEEP=$sweep on this machine: nothing resumed" |
    tee "$out/resume.log"
fi
[[ -z "${RESUME:-}" ]] || python3 scripts/resume_runs.py "$RESUME" "$out/runs" "$commit" | tee "$out/resume.log"
# CALL_SECS: the device call's limit (run's timeout_s; 600 s). Each stage's box is cut to what is left of it less
# PACK_SECS, so that the pack after the stage runs before the call ends: a stage the call's limit killed would take
# the output of its whole box with it (a sweep's records, a resume's starting point)
deadline=$((SECONDS + ${CALL_SECS:-600} - ${PACK_SECS:-20}))
stage() {  # stage <name> <seconds> <command...>
  local name=$1 secs=$2
  shift 2
  [[ "$only" == "  " || "$only" == *" $name "* ]] || return 0
  local left=$((deadline - SECONDS))
  if ((left < 5)); then
    echo "== $name: not run, ${left} s left before the call's end (CALL_SECS)" | tee -a "$out/summary.log"
    return 0
  fi
  ((left < secs)) && secs=$left
  echo "== $name (box ${secs} s)" | tee -a "$out/summary.log"
  timeout -k 5 "$secs" "$@" > "$out/$name.log" 2>&1  # killed 5 s after its TERM: the pack's margin holds
  echo "   exit $?" | tee -a "$out/summary.log"
  grep -v '%|' "$out/$name.log" | tail -5 | tee -a "$out/summary.log"
  tar -czf "${OUT:-/tmp}/gpu_session.tgz" -C "$out" .  # after every stage: a call cut short keeps what finished
}
(nvidia-smi --query-gpu=name,driver_version,memory.total,persistence_mode --format=csv
 python3 -c "import torch, triton, flashinfer; print(torch.__version__, triton.__version__, flashinfer.__version__)"
) > "$out/env.txt" 2>&1
# first: the host memory touched once before host-bound runs (the first job of a fresh machine gathered slowly,
# results/investigations/infinigen_threads/); its log gives the first-touch rate
stage host_warmup 150 python3 scripts/touch_host_memory.py ${HOST_WARMUP_GB:+--gb $HOST_WARMUP_GB}
stage pytest_gpu ${PYTEST_SECS:-420} python3 -m pytest -m gpu -q --durations=15 tests/
# FOCUS picks tests by name (-k), FOCUS_FILES the files (default tests/test_gpu.py, test_uva_gpu.py, test_clo_gpu.py)
gpu_tests="tests/test_gpu.py tests/test_uva_gpu.py tests/test_clo_gpu.py"
stage pytest_focus 200 python3 -m pytest -m gpu -q ${FOCUS_FILES:-$gpu_tests} \
  -k "${FOCUS:-retroinfer or fullattn or uva}"
stage bench_attn 240 python3 -m experiments.bench.bench_decode_attention --batches 1,2,4,8,16 --lengths 32k,64k,128k \
  --out "$out/decode_attention.json"
# paper Figures 3/13: each transfer path's bandwidth by volume and CPU threads, beside a bulk pinned copy
stage fig3_13 240 python3 -m experiments.bench.bench_link --out "$out/fig3_13_link/record.json"
# hardware.link_gb_s: every path paced to each cap (LINK_CAPS), its achieved rate beside the cap (docs/gpu.md, "A
# slower link"), then the cap's GPU tests (each path within 10 % of the cap, streams, graphs, capped runs)
stage link_cap 240 python3 -m experiments.bench.bench_link --link-gb-s ${LINK_CAPS:-8,16,21.21,32} \
  --threads ${LINK_CAP_THREADS:-8,16} --out "$out/link_cap/record.json"
stage pytest_link_cap 300 python3 -m pytest -m gpu -q --durations=10 tests/test_link_cap_gpu.py
# what the synthetic query process costs a step on its own, by batch (a workload's cost inside every system's step)
stage query_process 240 python3 -m experiments.bench.bench_query_process --out "$out/query_process.json"
# RetroInfer-style's CPU LRU alone at Figure 10's shapes, by threads, inline vs deferred (its step's host work)
stage lru 150 python3 -m experiments.bench.bench_lru --out "$out/lru.json"
# InfiniGen-style's CPU gather alone by pool size, memory kind, index pattern, threads and chunk
stage host_gather 240 python3 -m experiments.bench.bench_host_gather --tokens ${GATHER_TOKENS:-131072,524288} \
  --out "$out/host_gather.json"
# how long pinning a 64 GiB host store takes by cudaHostAlloc from one thread or from P at once (PIN_ALLOC_THREADS) vs
# N threads + cudaHostRegister (PIN_THREADS, hardware.pin_threads; results/bench/ has 8 and 16), and the link's rates
# on memory pinned each way
stage pin_alloc 330 python3 -m experiments.bench.bench_pin_alloc --gib ${PIN_GIB:-64} --threads ${PIN_THREADS:-0,16} \
  --thp-threads ${PIN_THP_THREADS:-16} --alloc-threads ${PIN_ALLOC_THREADS:-4,16} --out "$out/pin_alloc.json"
# InfiniGen-style's prefill skew: a sequence's Gram matrices by torch.linalg.eigh on the device vs the host
stage skew_eigh 60 python3 -m experiments.bench.bench_skew_eigh --out "$out/skew_eigh.json"
# RetroInfer-style's block copy against CLO's row gather and a bulk copy of the same bytes (Figure 10's shapes)
stage block_copy 120 python3 -m experiments.bench.bench_block_copy --out "$out/block_copy.json"
stage bench_clo 60 python3 -m experiments.bench.bench_clo --out "$out/bench_clo.json"
stage pytest_clo_gpu 120 python3 -m pytest -m gpu -q tests/test_gpu.py tests/test_clo_gpu.py -k clo
stage pytest_gemv 120 python3 -m pytest -m gpu -q tests/test_gemv.py
stage tune_gemv 240 python3 -m experiments.bench.tune_gemv --out "$out/gemv_tuning.json"
stage tune 180 python3 -m experiments.bench.tune_retrieval_kernels --out "$out/retrieval_tuning.json"
stage bench_clo_layer 150 python3 -m experiments.bench.bench_clo_layer --out "$out/clo_layer.json" --trace "$out/traces"
stage bench_clo_layer_speculative 300 python3 -m experiments.bench.bench_clo_layer --persist-query speculative \
  --out "$out/clo_layer_speculative.json" --trace "$out/traces_speculative" --uva-programs \
  ${LAYER_MS:+--layer-time-ms $LAYER_MS} ${LINK_GB_S:+--link-gb-s $LINK_GB_S}
run="python3 -m experiments.run --multirun results_dir=$out/runs"  # hydra wants its flags first
export run
sweeps() {  # sweeps <experiment> <override lists, ";" between sweeps>: each sweep in turn, into the same runs/
  local rc=0 s all parts=()
  IFS=';' read -ra all <<< "${2//$'\n'/ }"
  for s in "${all[@]}"; do [[ -z "${s//[[:space:]]/}" ]] || parts+=("$s"); done  # a blank list is no whole grid
  if ((${#parts[@]} == 0)); then
    [[ -z "${2//[[:space:]]/}" ]] || { echo "error: '$2': no override list between the ';'" >&2; return 2; }
    parts=("")  # no lists at all: the experiment's whole sweep
  fi
  for s in "${parts[@]}"; do $run "+experiment=$1" $s || rc=$?; done  # $s unquoted: one word per override
  return $rc
}
export -f sweeps
stage clo_graph 240 $run +experiment=clo_synthetic system=clo,fullattn seqlen=${SEQLENS:-32k,128k} workload.gen_tokens=32
# CLO's two persist_query modes at 128K; LAYER_MS and LINK_GB_S pin Eq. 12's inputs so that both runs get one plan
stage clo_persist_query 420 $run +experiment=clo_synthetic system=clo system.persist_query=real,speculative \
  system.layer_time_ms=${LAYER_MS:-null} system.link_gb_s=${LINK_GB_S:-null} seqlen=128k workload.gen_tokens=32
# one steady decode step of CLO at 128K as a Chrome trace per run (experiments.traces.step_timeline summarises it)
stage trace_128k 240 $run +experiment=clo_synthetic system=clo system.persist_query=${PERSIST_QUERY:-real} \
  system.layer_time_ms=${LAYER_MS:-null} \
  system.link_gb_s=${LINK_GB_S:-null} seqlen=128k workload.gen_tokens=12 \
  'trace_dir='"$out"'/trace_${system.persist_query}'
# FIG2 adds overrides, e.g. FIG2=model=qwen25 (the experiment fills the KV by the key process, Figure 10's workload)
# each run traces one steady step: a graph step's phases come from its kernels (record's trace_phase_ms)
stage fig2 ${FIG2_SECS:-300} $run +experiment=fig2_breakdown workload.gen_tokens=16 ${FIG2:-} \
  'trace_dir='"$out"'/trace_fig2/${hydra:runtime.choices.system}'
# the same steps neither traced nor phase-timed (an event pair a phase and layer slows a piecewise step): the
# figure's step times come from these, split as the traced runs split (plots.fig2_breakdown)
stage fig2_untimed ${FIG2_SECS:-300} $run +experiment=fig2_breakdown workload.gen_tokens=16 profile_phases=false ${FIG2:-}
# one steady decode step of each offloading baseline at 128K as a Chrome trace (experiments.traces.step_timeline)
stage trace_baselines 240 $run +experiment=fig2_breakdown system=retroinfer,infinigen workload.gen_tokens=8 \
  'trace_dir='"$out"'/trace_${hydra:runtime.choices.system}'
# paper Figure 10's points under the 48 GB budget; FIG10 narrows the sweep (e.g. "seqlen=32k batch=16 system=clo")
# or names several, ";" between them, run in turn (the blocks of a grid still missing, e.g. "seqlen=32k batch=32 ;
# seqlen=512k"); FIG10_SECS bounds them together (a timeout around this script would end the script, not the sweep)
stage fig10 ${FIG10_SECS:-540} bash -c 'sweeps "$@"' _ fig10_throughput "${FIG10:-}"
# every system's step and CLO's plan against the link cap at 128K BSZ 1 (LINKS narrows it or names more sweeps, ";"
# between them, e.g. "seqlen=32k batch=8" for the second point; LINKS_SECS bounds them together)
stage link_sensitivity ${LINKS_SECS:-540} bash -c 'sweeps "$@"' _ link_sensitivity "${LINKS:-}"
# beyond the paper's grid (BSZ 128/256 at 1K-4K; FIG10B='seqlen=704k,768k batch=1' for the long line; ";" as FIG10)
stage fig10_beyond ${FIG10B_SECS:-540} bash -c 'sweeps "$@"' _ fig10_beyond "${FIG10B:-}"
# one sweep across every GPU of the host (hydra/launcher=gpus), then on one GPU, wall times compared;
# the carried .whl must hold hydra-joblib-launcher and joblib (docs/scaleout.md)
stage multi_gpu 580 python3 -m experiments.bench.multi_gpu_sweep --out "$out/multi_gpu.json" --runs "$out/multi_gpu" \
  -- +experiment=fig10_throughput ${MULTI:-seqlen=8k batch=1,2,4,8}
# Figure 10 points with one steady step traced (the record's trace_phase_ms splits a graph step by its kernels):
# where a system's step stands against its floor; FIG10T picks the points
stage fig10_trace 300 $run +experiment=fig10_throughput ${FIG10T:-seqlen=8k,32k batch=8 system=clo} \
  'trace_dir='"$out"'/trace_fig10/${hydra:runtime.choices.system}_${seqlen}_b${batch}'
# Figure 10's prefill throughput: real prefills (fig10_throughput fills the KV by projection); FIG10P narrows it. A 4K
# sweep first fills the kernel caches on disk (Triton, numba), so that no measured prefill pays one-off compilation
stage fig10_prefill 400 bash -c "python3 -m experiments.run --multirun results_dir=$out/warmup \
  +experiment=fig10_prefill seqlen=4k batch=1 > $out/fig10_prefill_warmup.log 2>&1; \
  $run +experiment=fig10_prefill ${FIG10P:-}"
# what is alive at a system's device peak (default CLO at 128K BSZ 1; PEAK_SYSTEM, PEAK_BATCH, PEAK_SEQLEN)
stage memory_peak 300 bash -c "python3 -m experiments.run +experiment=fig10_throughput system=${PEAK_SYSTEM:-clo} \
  batch=${PEAK_BATCH:-1} seqlen=${PEAK_SEQLEN:-128k} memory_snapshot=$out/snapshot.pickle results_dir=$out/runs_peak && \
  python3 -m experiments.traces.memory_peak $out/snapshot.pickle --out $out/memory_peak.json && rm $out/snapshot.pickle"
stage ablation 200 $run +experiment=clo_synthetic system=clo +ablation=base,t,tg,tgp seqlen=128k workload.gen_tokens=16
# the baselines' top-k, radix select vs torch.topk; the sweep's first run is slower in every phase (cold process),
# so TOPK_AB can reorder it
stage topk_ab 300 $run +experiment=fig2_breakdown ${TOPK_AB:-system=retroinfer,infinigen system.topk=torch,radix} \
  workload.gen_tokens=16
stage fullattn_512k 450 $run +experiment=clo_synthetic system=fullattn seqlen=512k workload.gen_tokens=16
stage clo_512k 450 $run +experiment=clo_synthetic system=clo seqlen=512k workload.gen_tokens=16  # prefill ~3.5 min
cp "$out/summary.log" "${OUT:-/tmp}/summary.log"
