#!/usr/bin/env bash
# bind_rank.sh PROGRAM [ARGS...]: runs PROGRAM on the CPUs that UNIFAB_RANK_CPUS (CPUs or CPU
# ranges A-B, comma-separated) gives this process's rank, the r-th item (cycled), as unifab-launch
# pins its ranks;
# the rank comes from the MPI launcher (PMI_RANK: MPICH; PMIX_RANK; OMPI_COMM_WORLD_RANK) or
# UNIFAB_RANK. Without UNIFAB_RANK_CPUS it runs PROGRAM as it is. ntcompare puts nccl-tests' ranks
# on the CPUs unifab-bench's ranks get, so that both tools' processes run alike.
set -u
cpus="${UNIFAB_RANK_CPUS:-}"
[ -z "$cpus" ] && exec "$@"
rank="${PMI_RANK:-${PMIX_RANK:-${OMPI_COMM_WORLD_RANK:-${UNIFAB_RANK:-}}}}"
if ! [[ "$rank" =~ ^[0-9]+$ ]]; then
  echo "bind_rank.sh: no rank (PMI_RANK, PMIX_RANK, OMPI_COMM_WORLD_RANK or UNIFAB_RANK) to pick from UNIFAB_RANK_CPUS='$cpus'" >&2
  exit 2
fi
IFS=, read -r -a list <<<"$cpus"
cpu="${list[$((rank % ${#list[@]}))]}"
if ! [[ "$cpu" =~ ^([0-9]+)(-([0-9]+))?$ ]] || { [ -n "${BASH_REMATCH[3]}" ] && [ "${BASH_REMATCH[3]}" -lt "${BASH_REMATCH[1]}" ]; }; then
  echo "bind_rank.sh: UNIFAB_RANK_CPUS='$cpus': '$cpu' is not a CPU number or range (A-B, A <= B)" >&2
  exit 2
fi
exec taskset -c "$cpu" "$@"
