#!/usr/bin/env bash
# Build unifab on the GPU machine, run the ctest "gpu" label and the benchmarks, and leave logs
# and CSV files in $OUT (default ./gpu-results). One call does everything, to fit the device
# time budget. Usage: tests/run-gpu.sh [all|tests|bench]
set -uo pipefail

what="${1:-all}"
here="$(cd "$(dirname "$0")/.." && pwd)"
out="${OUT:-$here/gpu-results}"
build="${UNIFAB_GPU_BUILD_DIR:-$here/build-gpu}"
mkdir -p "$out"

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
  echo "== machine"; date -u; nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  nvidia-smi topo -m 2>/dev/null | head -5
  echo "NCCL_HOME=${NCCL_HOME:-unset}"; nproc
} 2>&1 | tee "$out/machine.txt"

echo "== build"
start=$(date +%s)
cmake -S "$here" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
  ${NCCL_HOME:+-DNCCL_HOME="$NCCL_HOME"} >"$out/build.log" 2>&1 &&
  cmake --build "$build" -j "$(nproc)" >>"$out/build.log" 2>&1
status=$?
echo "build: exit $status in $(( $(date +%s) - start )) s"; grep -E "unifab: (NCCL|CUDA)" "$out/build.log"
if [ $status -ne 0 ]; then tail -40 "$out/build.log"; exit 1; fi

failed=0
if [ "$what" = all ] || [ "$what" = tests ]; then
  echo "== gpu tests"
  (cd "$build" && ctest -L gpu --output-on-failure --timeout 1000) >"$out/ctest-gpu.log" 2>&1 || failed=1
  tail -15 "$out/ctest-gpu.log"
  cat "$build"/tests/gpu/nccl-debug.*.log 2>/dev/null | grep -E "unifab|Using network|via NET" | sort | uniq -c | sort -rn | head -20 >"$out/nccl-plugin-lines.txt"
fi

if [ "$what" = all ] || [ "$what" = bench ]; then
  echo "== benchmarks"
  bench="$build/tests/bench/unifab-bench"
  "$bench" net --min 4K --max 64M >"$out/bench-net-loopback.txt" 2>&1; cat "$out/bench-net-loopback.txt"
  run() {  # label, then unifab-bench coll arguments
    local label=$1; shift
    echo "-- $label"
    "$bench" coll --op all_reduce --min 8 --max 256M --iters 30 --warmup 5 --csv "$out/allreduce-$label.csv" "$@" \
      2>&1 | tee "$out/allreduce-$label.txt" | grep -E "^#|^ +(8|1048576|16777216|67108864|268435456) " || failed=1
  }
  run unifab --net unifab
  run unifab-ncclTuner --net unifab --tuner none
  run ncclSocket --net socket
  NCCL_SOCKET_NTHREADS=4 NCCL_NSOCKS_PERTHREAD=4 run ncclSocket-4x4 --net socket
  run nvlink --net nvlink
  echo "== all_reduce busbw (GB/s) by size"
  python3 - "$out" <<'EOF'
import csv, glob, os, sys
out = sys.argv[1]
runs = {}
for path in sorted(glob.glob(os.path.join(out, "allreduce-*.csv"))):
    label = os.path.basename(path)[len("allreduce-"):-4]
    with open(path) as f:
        runs[label] = {int(r["bytes"]): (float(r["time_us"]), float(r["busbw_gbs"])) for r in csv.DictReader(f)}
labels = [l for l in ["unifab", "unifab-ncclTuner", "ncclSocket", "ncclSocket-4x4", "nvlink"] if l in runs]
sizes = sorted({s for r in runs.values() for s in r})
print("%12s " % "bytes" + " ".join("%18s" % l for l in labels))
for s in sizes:
    print("%12d " % s + " ".join("%18s" % ("%.1fus %.2f" % runs[l][s] if s in runs[l] else "-") for l in labels))
if "unifab" in runs and "ncclSocket" in runs and 67108864 in runs["unifab"] and 67108864 in runs["ncclSocket"]:
    print("64 MiB all_reduce busbw: unifab %.2f GB/s vs NCCL Socket %.2f GB/s = %.2fx" % (
        runs["unifab"][67108864][1], runs["ncclSocket"][67108864][1],
        runs["unifab"][67108864][1] / runs["ncclSocket"][67108864][1]))
EOF
fi
exit $failed
