#!/usr/bin/env bash
# Adds unifab's perf tests (moe_dispatch_perf, moe_combine_perf, engram_read_perf, pp_sendrecv_perf)
# to an nccl-tests checkout of the pinned version and, with --build, builds nccl-tests with them:
#   nccl-tests-patches/apply.sh PATH_TO_NCCL_TESTS [--build]
# --build needs UNIFAB_HOME (an installed unifab: cmake --install BUILD --prefix DIR) and
# NCCL_HOME / CUDA_HOME as nccl-tests' Makefile uses them; with MPI_HOME (an MPI installation:
# include/mpi.h, lib/libmpi.so) it builds nccl-tests with MPI, to run one process per GPU
# (mpirun -n 2 BINARY -g 1) as multi-process jobs run.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
pinned="2.19.6"
tree="${1:?usage: apply.sh PATH_TO_NCCL_TESTS [--build]}"
build="${2:-}"
if ! grep -q "NCCL_TESTS_VERSION \"$pinned\"" "$tree/src/common.h" 2>/dev/null; then
  echo "apply.sh: $tree is not nccl-tests $pinned (src/common.h names $(grep -o 'NCCL_TESTS_VERSION "[^"]*"' "$tree/src/common.h" 2>/dev/null || echo nothing))" >&2
  exit 2
fi
if (cd "$tree" && git apply --reverse --check "$here/unifab-nccl-tests.patch" 2>/dev/null); then
  echo "apply.sh: already applied"
else
  (cd "$tree" && git apply "$here/unifab-nccl-tests.patch")
  echo "apply.sh: applied unifab-nccl-tests.patch to $tree"
fi
if [ "$build" = "--build" ]; then
  : "${UNIFAB_HOME:?--build needs UNIFAB_HOME, an installed unifab}"
  make -C "$tree/src" -j"$(nproc)" UNIFAB_HOME="$UNIFAB_HOME" ${NCCL_HOME:+NCCL_HOME="$NCCL_HOME"} \
    ${CUDA_HOME:+CUDA_HOME="$CUDA_HOME"} ${NVCC_GENCODE:+NVCC_GENCODE="$NVCC_GENCODE"} \
    ${MPI_HOME:+MPI=1 MPI_HOME="$MPI_HOME"}
fi
