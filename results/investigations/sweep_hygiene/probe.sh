#!/usr/bin/env bash
# Which job of an inline sweep starts with less free device memory, and by how much: the same two systems in both
# orders, and two jobs of one system. Prints one line per job in the order the jobs ran.
#   bash results/investigations/sweep_hygiene/probe.sh   # on a GPU machine, from the repository root
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-compute-apps=pid,used_memory --format=csv
for sweep in "seqlen=4k system=clo,fullattn" "seqlen=4k system=fullattn,clo" "seqlen=2k,4k system=fullattn"; do
  d=$(mktemp -d)
  python3 -m experiments.run --multirun model.weights=synthetic workload.gen_tokens=4 wandb.enabled=false \
    results_dir="$d" job_process=inline $sweep > "$d/sweep.log" 2>&1 || tail -5 "$d/sweep.log"
  echo "== $sweep"
  python3 - "$d" <<'PY'
import json, pathlib, sys
for p in sorted(pathlib.Path(sys.argv[1]).glob("*/record.json"), key=lambda p: p.stat().st_mtime):
    r = json.loads(p.read_text())
    print(f"   {r['system']:<9} seqlen {r['config']['seqlen']}: {r['environment']['device_free_gb_at_start']} GB free at start")
PY
done
