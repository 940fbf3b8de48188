#!/usr/bin/env bash
# unit.rank_cpus: unifab-launch and bind_rank.sh put rank r on the r-th CPU or CPU range of
# UNIFAB_RANK_CPUS (cycled), and both refuse a list that names no CPU with a message naming the
# variable.
# Usage: rank_cpus_test.sh UNIFAB_LAUNCH BIND_RANK_SH
set -u
launch=$1 bind=$2
failures=0
check() {  # WHAT EXPECTED ACTUAL
  if [ "$2" = "$3" ]; then echo "ok: $1"; else echo "FAILED: $1: expected '$2', got '$3'"; failures=$((failures + 1)); fi
}
allowed='grep -E "^Cpus_allowed_list" /proc/self/status | tr -d " \t" | sed "s/.*://"'
# The first and last CPUs this process may run on (a container may allow fewer than it has).
read -r first last < <(python3 -c 'import os; a = sorted(os.sched_getaffinity(0)); print(a[0], a[-1])')

got=$(UNIFAB_RANK_CPUS="$first,$last" "$launch" -n 2 -- sh -c "echo \$UNIFAB_RANK=\$($allowed)" | sort | tr '\n' ' ')
check "unifab-launch: rank r on the r-th CPU" "0=$first 1=$last " "$got"
got=$(UNIFAB_RANK_CPUS="$last" "$launch" -n 2 -- sh -c "$allowed" | sort -u | tr '\n' ' ')
check "unifab-launch: the list cycles" "$last " "$got"
# A range: every CPU this process may run on (those of the range it may not are left out).
mine=$(sh -c "$allowed")
got=$(UNIFAB_RANK_CPUS="$first-$last" "$launch" -n 2 -- sh -c "$allowed" | sort -u | tr '\n' ' ')
check "unifab-launch: a range" "$mine " "$got"
got=$(UNIFAB_RANK_CPUS="0,x" "$launch" -n 1 -- true 2>&1; echo "rc=$?")
check "unifab-launch: a bad list is refused" "1" "$(echo "$got" | grep -c "UNIFAB_RANK_CPUS='0,x': 'x' is not a CPU number or range")"
check "unifab-launch: a bad list's exit code" "rc=2" "$(echo "$got" | tail -1)"
for bad in "3-1" "1-" "-1" "1-2-3"; do
  got=$(UNIFAB_RANK_CPUS="$bad" "$launch" -n 1 -- true 2>&1; echo "rc=$?")
  check "unifab-launch: '$bad' is refused" "rc=2" "$(echo "$got" | tail -1)"
done

for r in 0 1; do
  got=$(PMI_RANK=$r UNIFAB_RANK_CPUS="$first,$last" "$bind" sh -c "$allowed")
  check "bind_rank.sh: PMI_RANK $r" "$( [ $r = 0 ] && echo $first || echo $last)" "$got"
done
got=$(PMI_RANK=1 UNIFAB_RANK_CPUS="$first,$first-$last" "$bind" sh -c "$allowed")
check "bind_rank.sh: a range" "$mine" "$got"
got=$(PMI_RANK=0 UNIFAB_RANK_CPUS="3-1" "$bind" true 2>&1; echo "rc=$?")
check "bind_rank.sh: a reversed range is refused" "rc=2" "$(echo "$got" | tail -1)"
got=$(env -u PMI_RANK -u PMIX_RANK -u OMPI_COMM_WORLD_RANK -u UNIFAB_RANK UNIFAB_RANK_CPUS=$first "$bind" true 2>&1; echo "rc=$?")
check "bind_rank.sh: no rank is refused" "rc=2" "$(echo "$got" | tail -1)"
got=$(env -u UNIFAB_RANK_CPUS "$bind" echo unbound)
check "bind_rank.sh: without a list the program runs as it is" "unbound" "$got"

[ "$failures" -eq 0 ] && echo "rank_cpus: all passed" || echo "rank_cpus: $failures failed"
exit "$((failures > 0))"
