#!/usr/bin/env bash
# Compares CPU allocators on the pipeline and DataParallel benchmarks and on a small CNN's step:
# glibc's malloc as paratrain sets it (keep_freed_memory: docs/allocator.md) and with glibc's
# defaults (PARATRAIN_KEEP_FREED_MEMORY=0), against Debian's mimalloc and jemalloc, preloaded.
# Runs are interleaved (glibc-defaults, glibc, mimalloc, jemalloc, glibc-defaults, ...) so that
# the machine's drift hits each alike, and the medians and their ratios to glibc's defaults are
# printed. Outside CI.
#   bash scripts/allocators.sh [repeats] [paratrain binary]
# PARATRAIN_ALLOCATOR_BENCHES=strategies leaves out the pipeline (ResNet-50, minutes a run).
set -euo pipefail
cd "$(dirname "$0")/.."
repeats="${1:-3}"
bin="${2:-build/bin/paratrain}"
limit="${PARATRAIN_ALLOCATOR_TIMEOUT:-240}"
lib=/usr/lib/x86_64-linux-gnu
declare -A preload=([glibc-defaults]="" [glibc]="" [mimalloc]="$lib/libmimalloc.so.2"
  [jemalloc]="$lib/libjemalloc.so.2")
allocators=(glibc-defaults glibc mimalloc jemalloc)
benches="${PARATRAIN_ALLOCATOR_BENCHES:-pipeline,strategies}"
for b in ${benches//,/ }; do
  if [ "$b" != pipeline ] && [ "$b" != strategies ]; then
    echo "allocators.sh: PARATRAIN_ALLOCATOR_BENCHES names '$b': use pipeline, strategies or both" >&2
    exit 2
  fi
done
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# run NAME ALLOCATOR ARGS...: one benchmark run, its JSON rows tagged with the allocator.
run() {
  local name="$1" alloc="$2"
  shift 2
  local rows="$out/$name.$alloc.jsonl"
  local t0=$SECONDS
  local keep=1
  if [ "$alloc" = "glibc-defaults" ]; then keep=0; fi
  if PARATRAIN_KEEP_FREED_MEMORY=$keep LD_PRELOAD="${preload[$alloc]}" timeout "$limit" "$bin" bench "$@" --json >"$out/last" 2>/dev/null; then
    sed "s/^{/{\"allocator\": \"$alloc\", /" "$out/last" >>"$rows"
    echo "$name $alloc: $((SECONDS - t0)) s" >&2
  else
    echo "{\"allocator\": \"$alloc\", \"failed\": true}" >>"$rows"
    echo "$name $alloc: no result within ${limit} s" >&2
  fi
}

for ((r = 1; r <= repeats; r++)); do
  for alloc in "${allocators[@]}"; do
    for f in "${!preload[@]}"; do
      if [ -n "${preload[$f]}" ] && [ ! -e "${preload[$f]}" ]; then
        echo "allocators.sh: ${preload[$f]} is missing (apt install libmimalloc2.0 libjemalloc2)" >&2
        exit 1
      fi
    done
    if [[ ",$benches," == *,pipeline,* ]]; then
      run pipeline "$alloc" pipeline --chunks 4 --steps 2 --batch-size 32
    fi
    if [[ ",$benches," == *,strategies,* ]]; then
      run strategies "$alloc" strategies --workloads mlp,resnet18,cnn --steps 5
    fi
  done
done

python3 - "$out" <<'PY'
import json, statistics, sys, glob, os
out = sys.argv[1]
def rows(name, alloc):
    path = os.path.join(out, f"{name}.{alloc}.jsonl")
    return [json.loads(l) for l in open(path)] if os.path.exists(path) else []
# What each benchmark is judged by: 1F1B images/s (higher is better), step times.
metrics = [("pipeline", "1f1b images/s", lambda r: r.get("mode") == "1f1b", "images_per_second", True),
           ("strategies", "dp mlp step ms", lambda r: r.get("strategy") == "dp" and r.get("workload") == "mlp", "step_seconds", False),
           ("strategies", "dp resnet18 step s", lambda r: r.get("strategy") == "dp" and r.get("workload") == "resnet18", "step_seconds", False),
           ("strategies", "cnn step ms", lambda r: r.get("strategy") == "single" and r.get("workload") == "cnn", "step_seconds", False)]
print(f"{'metric':22} {'allocator':14} {'runs':>4} {'median':>10} {'vs defaults':>11}")
for name, label, pick, key, higher in metrics:
    if not glob.glob(os.path.join(out, f"{name}.*.jsonl")):
        continue  # not asked for (PARATRAIN_ALLOCATOR_BENCHES)
    base = None
    for alloc in ("glibc-defaults", "glibc", "mimalloc", "jemalloc"):
        rs = rows(name, alloc)
        vals = [r[key] * (1000 if label.endswith("ms") else 1) for r in rs if pick(r)]
        failed = sum(1 for r in rs if r.get("failed"))
        if not vals:
            print(f"{label:22} {alloc:14} {0:>4} {'-':>10} {'-':>11}  ({failed} runs without a result)")
            continue
        med = statistics.median(vals)
        if alloc == "glibc-defaults":
            base = med
        ratio = (med / base if higher else base / med) if base else float("nan")
        note = f"  ({failed} runs without a result)" if failed else ""
        print(f"{label:22} {alloc:14} {len(vals):>4} {med:>10.3f} {ratio:>10.2f}x{note}")
print("vs defaults: speed relative to glibc's defaults (above 1 is faster); glibc: as paratrain sets it")
PY
