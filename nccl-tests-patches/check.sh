#!/usr/bin/env bash
# CI check of the nccl-tests patches, when an nccl-tests checkout of the pinned version is given
# (NCCL_TESTS_SRC): the committed patch is what make-patch.sh makes from src/, it applies cleanly
# to a copy, and unifab's tests build with both build systems against the installed unifab
# (UNIFAB_HOME). Without NCCL_TESTS_SRC it says so and succeeds.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [ -z "${NCCL_TESTS_SRC:-}" ]; then
  echo "nccl-tests patches: skipped (set NCCL_TESTS_SRC to a git checkout of nccl-tests v2.19.6 to check them)"
  exit 0
fi
: "${UNIFAB_HOME:?check.sh needs UNIFAB_HOME, an installed unifab}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$here/make-patch.sh" "$NCCL_TESTS_SRC" "$work/regenerated.patch" >/dev/null
diff -q "$work/regenerated.patch" "$here/unifab-nccl-tests.patch" >/dev/null ||
  { echo "nccl-tests patches: unifab-nccl-tests.patch is stale: run nccl-tests-patches/make-patch.sh" >&2; exit 1; }
git -C "$NCCL_TESTS_SRC" archive HEAD | (mkdir -p "$work/tree" && tar -x -C "$work/tree")
"$here/apply.sh" "$work/tree" >/dev/null
gencode="-gencode=arch=compute_90,code=sm_90"
# A plain `make` (the default goal) must build unifab's tests next to nccl-tests' own.
default_goal="$(make -n -C "$work/tree/src" UNIFAB_HOME="$UNIFAB_HOME" BUILDDIR="$work/make" 2>/dev/null || true)"
for binary in all_reduce_perf moe_dispatch_perf moe_combine_perf engram_read_perf pp_sendrecv_perf; do
  grep -q -- "-o $work/make/$binary " <<<"$default_goal" ||
    { echo "nccl-tests patches: a plain make does not build $binary" >&2; exit 1; }
done
make -C "$work/tree/src" -j"$(nproc)" UNIFAB_HOME="$UNIFAB_HOME" ${NCCL_HOME:+NCCL_HOME="$NCCL_HOME"} \
  NVCC_GENCODE="$gencode" BUILDDIR="$work/make" "$work/make/moe_dispatch_perf" "$work/make/moe_combine_perf" "$work/make/engram_read_perf" "$work/make/pp_sendrecv_perf" >/dev/null
cmake -S "$work/tree" -B "$work/cmake" -DUNIFAB_HOME="$UNIFAB_HOME" -DCMAKE_CUDA_ARCHITECTURES=90 \
  ${NCCL_HOME:+-DNCCL_HOME="$NCCL_HOME"} >/dev/null
cmake --build "$work/cmake" -j"$(nproc)" --target moe_dispatch_perf moe_combine_perf engram_read_perf pp_sendrecv_perf >/dev/null
echo "nccl-tests patches: apply to $(grep -o '"[0-9.]*"' "$work/tree/src/common.h" | head -1) and build with make and CMake"
