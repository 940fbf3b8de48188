#!/usr/bin/env bash
# Build unifab on the GPU machine, run the ctest "gpu" label and the benchmarks in one call (the
# device time budget favours few, full calls). Results: $OUT/summary.txt (what the closing notes
# and docs/benchmarks quote) and $OUT/logs.tar.gz (every log and CSV).
#   tests/run-gpu.sh [all|tests|bench|sweep]...      default: all = tests + bench
set -uo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
out="${OUT:-$here/gpu-results}"
logs="$out/logs"
build="${UNIFAB_GPU_BUILD_DIR:-$here/build-gpu}"
mkdir -p "$logs"
steps="${*:-all}"
[ "$steps" = all ] && steps="tests bench"
summary="$out/summary.txt"
: >"$summary"
say() { echo "$@" | tee -a "$summary"; }

# The device API must match the runtime: use PyTorch's NCCL (2.28.9 here), never the system one.
if [ -z "${NCCL_HOME:-}" ]; then
  for candidate in /opt/torch/.venv/lib/python3*/site-packages/nvidia/nccl; do
    [ -f "$candidate/include/nccl.h" ] && export NCCL_HOME="$candidate"
  done
fi
export PATH="/opt/torch/.venv/bin:/usr/local/cuda/bin:$PATH"
export LD_LIBRARY_PATH="${NCCL_HOME:+$NCCL_HOME/lib:}${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0            # NVLink multicast is banned on these machines
export NCCL_SOCKET_IFNAME=lo UNIFAB_SOCKET_IFNAME=lo

{
  date -u
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  nvidia-smi topo -m 2>/dev/null | sed -n 2,3p
  echo "NCCL_HOME=${NCCL_HOME:-unset}, $(nproc) cores"
} 2>&1 | tee -a "$summary"

start=$(date +%s)
cmake -S "$here" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
  ${NCCL_HOME:+-DNCCL_HOME="$NCCL_HOME"} >"$logs/build.log" 2>&1 &&
  cmake --build "$build" -j "$(nproc)" >>"$logs/build.log" 2>&1
status=$?
say "build: exit $status in $(( $(date +%s) - start )) s; $(grep -E -o 'NCCL [0-9.]+ \(code [0-9]+\) from [^:]*' "$logs/build.log")"
if [ $status -ne 0 ]; then tail -40 "$logs/build.log"; tar -czf "$out/logs.tar.gz" -C "$out" logs; rm -rf "$logs"; exit 1; fi
bench="$build/tests/bench/unifab-bench"

failed=0
coll() {  # label, then unifab-bench coll arguments; writes $logs/<label>.{txt,csv}
  local label=$1; shift
  "$bench" coll --csv "$logs/$label.csv" "$@" >"$logs/$label.txt" 2>&1 || { failed=1; say "FAILED: $label"; tail -5 "$logs/$label.txt"; }
}
table() {  # op, then labels: busbw and time per size side by side
  python3 - "$logs" "$@" <<'EOF' | tee -a "$summary"
import csv, os, sys
logs, op, labels = sys.argv[1], sys.argv[2], sys.argv[3:]
runs = {}
for label in labels:
    path = os.path.join(logs, label + ".csv")
    if os.path.exists(path):
        with open(path) as f:
            runs[label] = {int(r["bytes"]): (float(r["time_us"]), float(r["busbw_gbs"])) for r in csv.DictReader(f)}
labels = [l for l in labels if l in runs]
sizes = sorted({s for r in runs.values() for s in r})
print("%s: time (us) / busbw (GB/s), median of the slowest rank" % op)
print("%11s " % "bytes" + "".join("%22s" % l for l in labels))
for s in sizes:
    print("%11d " % s + "".join("%22s" % ("%.1f / %.2f" % runs[l][s] if s in runs[l] else "-") for l in labels))
EOF
}

for step in $steps; do
  case $step in
  tests)
    say "== gpu tests (ctest -L gpu)"
    (cd "$build" && ctest -L gpu --output-on-failure --timeout 1000) >"$logs/ctest-gpu.log" 2>&1 || failed=1
    grep -E "tests passed|Passed|Failed|\*\*\*" "$logs/ctest-gpu.log" | tee -a "$summary"
    grep -h -E "passed, [0-9]+ failed" "$logs/ctest-gpu.log" | tee -a "$summary"
    cat "$build"/tests/gpu/nccl-debug*.log 2>/dev/null | grep -o -E "(NET/Plugin: Loaded net plugin unifab.*|Using network unifab|TUNER/Plugin: Using unifab.*|via NET/unifab/[0-9]+)" |
      sort | uniq -c | tee -a "$summary"
    cp "$build"/tests/gpu/nccl-debug*.log "$logs/" 2>/dev/null
    ;;
  bench)
    say "== unifab-bench net (loopback, no NCCL)"
    "$bench" net --min 4K --max 64M >"$logs/net-loopback.txt" 2>&1 || failed=1
    tee -a "$summary" <"$logs/net-loopback.txt"
    say "== all_reduce, 2 GPUs, NET forced (P2P/SHM off) over loopback"
    common=(--op all_reduce --min 4 --max 256M --factor 4 --iters 30 --warmup 5)
    coll unifab --net unifab "${common[@]}"
    coll unifab-nccltuner --net unifab --tuner none "${common[@]}"
    coll ncclsocket --net socket "${common[@]}"
    NCCL_SOCKET_NTHREADS=4 NCCL_NSOCKS_PERTHREAD=4 coll ncclsocket-4x4 --net socket "${common[@]}"
    coll nvlink --net nvlink "${common[@]}"
    table all_reduce unifab unifab-nccltuner ncclsocket ncclsocket-4x4 nvlink
    for op in all_gather reduce_scatter alltoall; do
      coll "$op-unifab" --net unifab --op $op --min 1M --max 256M --factor 16 --iters 20
      coll "$op-ncclsocket" --net socket --op $op --min 1M --max 256M --factor 16 --iters 20
      table $op "$op-unifab" "$op-ncclsocket"
    done
    ;;
  sweep)
    say "== socket transport settings, all_reduce over unifab"
    args=(--net unifab --op all_reduce --min 4 --max 256M --factor 16 --iters 20 --warmup 3)
    labels=()
    for streams in 2 4 8; do
      for threads in 2 4 8; do
        UNIFAB_SOCKET_NSTREAMS=$streams UNIFAB_SOCKET_NTHREADS=$threads coll "s${streams}t${threads}" "${args[@]}"
        labels+=("s${streams}t${threads}")
      done
    done
    UNIFAB_SOCKET_BUSY_POLL_US=0 coll "s4t4-nopoll" "${args[@]}"; labels+=(s4t4-nopoll)
    UNIFAB_SOCKET_SPEED_MBPS=100000 coll "s4t4-100g" "${args[@]}"; labels+=(s4t4-100g)
    table all_reduce "${labels[@]}"
    ;;
  *) echo "unknown step $step"; failed=1 ;;
  esac
done
tar -czf "$out/logs.tar.gz" -C "$out" logs && rm -rf "$logs"
exit $failed
