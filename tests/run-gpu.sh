#!/usr/bin/env bash
# Build unifab on the GPU machine, run the ctest "gpu" label and the benchmarks in one call (the
# device time budget favours few, full calls). Results: $OUT/summary.txt (what the closing notes
# and docs/benchmarks quote) and $OUT/logs.tar.gz (every log and CSV); with UNIFAB_GPU_TAG=T,
# $OUT/summary-T.txt and $OUT/logs-T.tar.gz, so that several invocations in one device call keep
# their own.
#   tests/run-gpu.sh [tests] [bench] [ep] [ll] [pp] [copyroutes] [memrates] [engram] [nccltests] [ntcompare] [tunesweep] [epsweep] [trace] [lltrace] [llncu] [sanitize] [sweep] [ab]
#   default: tests bench ep ll pp engram
# UNIFAB_GPU_TESTS=REGEX limits the tests step to the gpu tests whose names match;
# UNIFAB_TUNESWEEP_CHANNELS replaces the forced channel counts (NVLink 8,24,32; unifab 1,2,8).
# UNIFAB_TUNESWEEP_NETS / UNIFAB_TUNESWEEP_OPS limit the tunesweep step (per op, 3 repetitions, x8
# sizes to 128 MiB: ~1-2 min over NVLink, ~2-2.5 min over unifab; the default x4 sizes to 1 GiB take
# about twice that: one or two ops per device call; UNIFAB_TUNESWEEP_REPS changes the repetitions,
# UNIFAB_TUNESWEEP_SIZES the sizes, e.g. "--min 8 --max 256M --factor 8");
# UNIFAB_TRACE_DTYPES / UNIFAB_TRACE_OPS limit the trace step (default: bf16 fp8 x empty cached dispatch combine);
# UNIFAB_COPYROUTES_ARGS / UNIFAB_ENGRAM_ARGS replace the copyroutes / engram steps' arguments;
# UNIFAB_LLTRACE_TOKENS (default "1 128") and UNIFAB_LLTRACE_DTYPE (default fp8) set the lltrace step's runs,
# UNIFAB_LLTRACE_ARGS adds bench arguments to them (e.g. "--flush-mib 0": warm caches), UNIFAB_LLTRACE_OPS
# the bench ops traced (default combine, which follows a whole dispatch; pair: no flush between them);
# llncu samples, with Nsight Compute, where the warps of one LL kernel (UNIFAB_LLNCU_KERNEL, default
# llDispatchKernel) stall, per SASS instruction, on one GPU (UNIFAB_LLNCU_TOKENS tokens, default 1);
# ab measures the working tree against itself with UNIFAB_AB_PATCH (default ab.patch; or several
# NAME=FILE baselines) reversed, interleaved (UNIFAB_AB_ARGS, UNIFAB_AB_DTYPES, UNIFAB_AB_REPS,
# UNIFAB_AB_COLUMNS, UNIFAB_AB_TEST: a gpu test that each baseline must pass to be timed;
# UNIFAB_AB_DTYPES=- for a benchmark without --dtype);
# UNIFAB_GPU_TESTS_LIMIT_S bounds the whole tests step (default 360 s: the 28 tests take ~170 s,
# and a device call ends at 600 s) so that a hang still leaves its logs and the later steps run;
# UNIFAB_SANITIZE_LIMIT_S bounds each compute-sanitizer run (default 150 s), UNIFAB_SANITIZE_TESTS
# picks the EP tests it runs under (default: ht ll). nccltests needs
# nccl-tests v2.19.6 in NCCL_TESTS_SRC (default: .nccl-tests-src, an ignored folder to `carry`),
# as does ntcompare (UNIFAB_NTCOMPARE_REPS, UNIFAB_NTCOMPARE_HOST_REPS, UNIFAB_NTCOMPARE_TESTS,
# UNIFAB_NTCOMPARE_CPUS: see the step).
# The machines are shared virtual machines whose loopback TCP speed changes from minute to
# minute, so every comparison runs its contenders interleaved, several times, and reports the
# median over the repetitions.
set -uo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
out="${OUT:-$here/gpu-results}"
# Logs live outside $OUT and go back as one tarball, refreshed after every step: a call that runs
# past the device's limit still returns the summary and the logs of the steps it finished (a
# folder of logs in $OUT would exceed the count of files that come back).
logs="$(mktemp -d "${TMPDIR:-/tmp}/unifab-gpu.XXXXXX")/logs"
build="${UNIFAB_GPU_BUILD_DIR:-$here/build-gpu}"
mkdir -p "$logs" "$out"
tag="${UNIFAB_GPU_TAG:+-$UNIFAB_GPU_TAG}"
pack() { tar -czf "$out/logs$tag.tar.gz.part" -C "$(dirname "$logs")" logs && mv "$out/logs$tag.tar.gz.part" "$out/logs$tag.tar.gz"; }
steps="${*:-tests bench ep ll pp engram}"
summary="$out/summary$tag.txt"
: >"$summary"
say() { echo "$@" | tee -a "$summary"; }

# The device API must match the runtime: use PyTorch's NCCL (2.28.9 here), never the system one.
if [ -z "${NCCL_HOME:-}" ]; then
  for candidate in /opt/torch/.venv/lib/python3*/site-packages/nvidia/nccl; do
    [ -f "$candidate/include/nccl.h" ] && export NCCL_HOME="$candidate"
  done
fi
[ -d /opt/torch/.venv/bin ] && export PATH="/opt/torch/.venv/bin:$PATH"
export PATH="/usr/local/cuda/bin:$PATH"
export LD_LIBRARY_PATH="${NCCL_HOME:+$NCCL_HOME/lib:}${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0            # NVLink multicast is banned on these machines
export NCCL_SOCKET_IFNAME=lo UNIFAB_SOCKET_IFNAME=lo

{
  date -u
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  nvidia-smi topo -m 2>/dev/null | sed -n 2,3p
  echo "NCCL_HOME=${NCCL_HOME:-unset}, $(nproc) cores"
} 2>&1 | tee -a "$summary"

# configure SOURCE BUILD: the device build's configuration, for this tree and the ab step's
# baselines alike (line info for the profilers: -lineinfo changes no code).
configure() {
  cmake -S "$1" -B "$2" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_FLAGS=-lineinfo \
    ${NCCL_HOME:+-DNCCL_HOME="$NCCL_HOME"}
}

start=$(date +%s)
configure "$here" "$build" >"$logs/build.log" 2>&1 &&
  cmake --build "$build" -j "$(nproc)" >>"$logs/build.log" 2>&1
status=$?
say "build: exit $status in $(( $(date +%s) - start )) s; $(grep -E -o 'NCCL [0-9.]+ \(code [0-9]+\) from [^:]*' "$logs/build.log")"
if [ $status -ne 0 ]; then tail -40 "$logs/build.log"; pack; exit 1; fi
bench="$build/tests/bench/unifab-bench"
failed=0

# Which device-to-device copies stay off the SMs (the zero-SM operations depend on it); the pp
# step runs it first, the copyroutes step alone (UNIFAB_COPYROUTES_ARGS replaces its arguments).
copy_routes() {
  local routes_args="${UNIFAB_COPYROUTES_ARGS:---bytes 256M --busy-ms 40}"
  say "== unifab-bench copy-routes $routes_args: which copies stay off the SMs"
  "$bench" copy-routes $routes_args >"$logs/copy-routes.txt" 2>&1 || failed=1
  tee -a "$summary" <"$logs/copy-routes.txt"
}

# table DESCRIPTION LABEL...: per-size median over the repetitions of each label's runs.
table() {
  python3 "$here/tests/bench/median_table.py" "$logs" "$@" | tee -a "$summary"
}

# compare REPS "COMMON ARGS" -- LABEL [NAME=VALUE|ARG]... -- LABEL ...
# Runs every label REPS times, interleaved, with its environment settings and arguments.
compare() {
  local reps=$1 common=$2
  shift 2
  local specs=() labels=() spec=""
  for item in "$@" --; do
    if [ "$item" = "--" ]; then
      [ -n "$spec" ] && specs+=("$spec") && labels+=("${spec%% *}")
      spec=""
    else
      spec="${spec:+$spec }$item"
    fi
  done
  for rep in $(seq 1 "$reps"); do
    for spec in "${specs[@]}"; do
      local words=($spec) envs=() args=()
      local label=${words[0]}
      for item in "${words[@]:1}"; do
        case $item in *=*) envs+=("$item") ;; *) args+=("$item") ;; esac
      done
      env "${envs[@]}" "$bench" coll $common "${args[@]}" --csv "$logs/$label.rep$rep.csv" \
        >"$logs/$label.rep$rep.txt" 2>&1 || { failed=1; say "FAILED: $label rep $rep"; tail -5 "$logs/$label.rep$rep.txt"; }
    done
  done
  table "$common" "${labels[@]}"
}

# nccl-tests with unifab's patch, built against this build installed (once per call): sets
# launch / per_rank (one process per GPU under MPI when there is one: UNIFAB_MPI_HOME, or an MPICH
# wheel carried in .whl/, pip download mpich; else nccl-tests' threads, -t 2, where the two ranks
# share one process's driver), mpi_home, and b (the binaries' folder). ntrun runs one test.
nt_ready=""
nccl_tests_setup() {
  src="${NCCL_TESTS_SRC:-$here/.nccl-tests-src}"
  mpi_home="${UNIFAB_MPI_HOME:-}"
  local wheel
  wheel="$(ls "$here"/.whl/mpich-*.whl 2>/dev/null | head -1)"
  if [ -z "$mpi_home" ] && [ -n "$wheel" ] && [ "${UNIFAB_NCCLTESTS_THREADS:-0}" != 1 ]; then
    rm -rf /tmp/unifab-mpich && python3 -m zipfile -e "$wheel" /tmp/unifab-mpich &&
      mpi_home="$(echo /tmp/unifab-mpich/mpich-*.data/data)" && chmod +x "$mpi_home"/bin/*
  fi
  if [ -n "$mpi_home" ]; then
    launch=("$mpi_home/bin/mpirun" -n 2) per_rank=(-g 1)
    export LD_LIBRARY_PATH="$mpi_home/lib:$LD_LIBRARY_PATH"
  else
    launch=() per_rank=(-t 2 -g 1)
  fi
  nt=/tmp/unifab-nccl-tests
  b="$nt/build"
  [ -n "$nt_ready" ] && return 0
  say "== nccl-tests $(grep -o 'NCCL_TESTS_VERSION "[^"]*"' "$src/src/common.h" 2>/dev/null) + unifab patch, ${launch[*]:-one process} ${per_rank[*]}"
  rm -rf "$nt" && cp -r "$src" "$nt" && cmake --install "$build" --prefix "$build/inst" >"$logs/nccl-tests-build.log" 2>&1 &&
    UNIFAB_HOME="$build/inst" NVCC_GENCODE="-gencode=arch=compute_90,code=sm_90" MPI_HOME="$mpi_home" \
    "$here/nccl-tests-patches/apply.sh" "$nt" --build >>"$logs/nccl-tests-build.log" 2>&1
  if [ $? -ne 0 ]; then failed=1; say "nccl-tests build FAILED"; tail -20 "$logs/nccl-tests-build.log" | tee -a "$summary"; return 1; fi
  nt_ready=1
}
# logged OUT COMMAND ARGS...: the command's output in OUT; a failure marks the call failed and puts
# OUT's last lines in the summary. Variables for one command go through env (under MPI after the
# launcher: `mpirun -n 2 env NAME=VALUE BINARY`).
logged() {
  local out=$1; shift
  "$@" >"$out" 2>&1 && return 0
  failed=1; say "FAILED: $*"; tail -5 "$out" | tee -a "$summary"; return 1
}
ntrun() {  # LABEL [NAME=VALUE]... BINARY ARGS... (the launcher and the per-rank GPU options added)
  local label=$1; shift
  logged "$logs/nt-$label.txt" "${launch[@]}" env "$@" "${per_rank[@]}"
  say "-- $label: ${launch[*]} $* ${per_rank[*]}"
  grep -E "^ +[0-9]+ |Out of bounds|wrong|#wrong|Avg bus|PP trace:" "$logs/nt-$label.txt" | sed 's/^.*\(PP trace:\)/\1/' |
    tee -a "$summary"
  grep -E "failure|FAILED|error" "$logs/nt-$label.txt" | head -5 | tee -a "$summary"
}

for step in $steps; do
  case $step in
  tests)
    say "== gpu tests (ctest -L gpu)"
    (cd "$build" && timeout -k 10 "${UNIFAB_GPU_TESTS_LIMIT_S:-360}" \
      ctest -L gpu ${UNIFAB_GPU_TESTS:+-R "$UNIFAB_GPU_TESTS"} -V --timeout 1000) >"$logs/ctest-gpu.log" 2>&1 || failed=1
    grep -E "tests passed|Passed|Failed|\*\*\*" "$logs/ctest-gpu.log" | tee -a "$summary"
    grep -h -E "passed, [0-9]+ failed" "$logs/ctest-gpu.log" | tee -a "$summary"
    cat "$build"/tests/gpu/nccl-debug*.log 2>/dev/null |
      grep -o -E "(NET/Plugin: Loaded net plugin unifab.*|Using network unifab|TUNER/Plugin: Using unifab.*|via NET/unifab/[0-9]+)" |
      sort | uniq -c | tee -a "$summary"
    cp "$build"/tests/gpu/nccl-debug*.log "$logs/" 2>/dev/null
    ;;
  bench)
    say "== unifab-bench net (loopback, no NCCL)"
    "$bench" net --min 4K --max 64M >"$logs/net-loopback.txt" 2>&1 || failed=1
    tee -a "$summary" <"$logs/net-loopback.txt"
    say "== all_reduce, 2 GPUs, NET forced (P2P/SHM off) over loopback"
    compare 3 "--op all_reduce --min 4 --max 256M --factor 4 --iters 30 --warmup 5" \
      -- unifab --net unifab -- unifab-nccltuner --net unifab --tuner none \
      -- ncclsocket --net socket -- ncclsocket-4x4 --net socket NCCL_SOCKET_NTHREADS=4 NCCL_NSOCKS_PERTHREAD=4
    compare 1 "--op all_reduce --min 4 --max 256M --factor 4 --iters 30 --warmup 5" -- nvlink --net nvlink
    for op in all_gather reduce_scatter alltoall; do
      compare 2 "--op $op --min 1M --max 256M --factor 16 --iters 20" \
        -- "$op-unifab" --net unifab -- "$op-ncclsocket" --net socket
    done
    ;;
  ep)
    say "== unifab-bench ep --mode ht, all local GPUs"
    for dtype in bf16 fp8; do
      "$bench" ep --mode ht --dtype $dtype --iters 30 --warmup 5 --csv "$logs/ep-ht-$dtype.csv" >"$logs/ep-ht-$dtype.txt" 2>&1 || failed=1
      tee -a "$summary" <"$logs/ep-ht-$dtype.txt"
    done
    "$bench" ep --mode ht --dtype bf16 --sms 24 --iters 30 --warmup 5 --csv "$logs/ep-ht-bf16-24sms.csv" >"$logs/ep-ht-bf16-24sms.txt" 2>&1 || failed=1
    tee -a "$summary" <"$logs/ep-ht-bf16-24sms.txt"
    ;;
  ll)
    say "== unifab-bench ep --mode ll, all local GPUs"
    for dtype in fp8 bf16; do
      "$bench" ep --mode ll --dtype $dtype --tokens 1,32,128 --iters 50 --warmup 10 --csv "$logs/ep-ll-$dtype.csv" \
        >"$logs/ep-ll-$dtype.txt" 2>&1 || failed=1
      tee -a "$summary" <"$logs/ep-ll-$dtype.txt"
    done
    # The floor of one token handed over by a one-block kernel per GPU (tests/bench/message_floor.h).
    "$bench" ep --mode ll --tokens 1 --ops floor --iters 50 --warmup 10 >"$logs/ep-ll-floor.txt" 2>&1 || failed=1
    tee -a "$summary" <"$logs/ep-ll-floor.txt"
    ;;
  copyroutes) copy_routes ;;
  memrates)
    say "== unifab-bench memrates: L2 latencies, a word's round trip between SMs, one warp's and one SM's rates"
    "$bench" memrates >"$logs/memrates.txt" 2>&1 || failed=1
    tee -a "$summary" <"$logs/memrates.txt"
    ;;
  pp)
    copy_routes
    say "== unifab-bench pp, rank 0 -> rank 1 (default engine: rendezvous)"
    "$bench" pp --min 4K --max 1G --factor 4 --iters 20 --warmup 3 --csv "$logs/pp.csv" >"$logs/pp.txt" 2>&1 || failed=1
    tee -a "$summary" <"$logs/pp.txt"
    say "== unifab-bench pp, slots engine (UNIFAB_PP_ENGINE=slots)"
    UNIFAB_PP_ENGINE=slots UNIFAB_PP_TIMEOUT_MS=20000 "$bench" pp --min 4K --max 1G --factor 4 --iters 20 --warmup 3 \
      --csv "$logs/pp-slots.csv" >"$logs/pp-slots.txt" 2>&1 || failed=1
    tee -a "$summary" <"$logs/pp-slots.txt"
    ;;
  engram)
    say "== unifab-bench engram, random rows of the peer GPU"
    "$bench" engram ${UNIFAB_ENGRAM_ARGS:---rows 256,1K,4K,14K,64K --fetch 64M --iters 20} --csv "$logs/engram.csv" >"$logs/engram.txt" 2>&1 || failed=1
    tee -a "$summary" <"$logs/engram.txt"
    ;;
  nccltests)
    # nccl-tests with unifab's patch next to unifab-bench on the same shapes (the two must agree
    # within 5 %: ntcompare checks it).
    nccl_tests_setup || continue
    # nccl-tests allocates its buffers with ncclMemAlloc (cuMem), which legacy CUDA IPC cannot map
    # into another process; the rendezvous engine maps them through their shared handles. PP runs
    # on the slots engine across processes (the runs compared with unifab-bench), on the
    # rendezvous engine across processes (pp-one-way-rendezvous) and with threads.
    pp_env=()
    [ -n "$mpi_home" ] && pp_env=(UNIFAB_PP_ENGINE=slots)
    ntrun pp-check "${pp_env[@]}" "$b/pp_sendrecv_perf" -b 4K -e 1G -f 4 -c 1 -n 20 -w 3
    # The one-way runs log where each call's host time goes (UNIFAB_PP_TRACE; "PP trace:" lines,
    # over all sizes, out of place and in place together).
    pp_trace=(UNIFAB_PP_TRACE=1 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=P2P)
    ntrun pp-one-way "${pp_env[@]}" "${pp_trace[@]}" UNIFAB_PP_ONE_WAY=1 "$b/pp_sendrecv_perf" -b 4K -e 1G -f 4 -c 1 -n 20 -w 3
    [ -n "$mpi_home" ] && ntrun pp-one-way-rendezvous "${pp_trace[@]}" UNIFAB_PP_ONE_WAY=1 "$b/pp_sendrecv_perf" -b 4K -e 1G -f 4 -c 1 -n 20 -w 3
    if [ -n "$mpi_home" ]; then
      launch=() per_rank=(-t 2 -g 1)
      ntrun pp-one-way-threads UNIFAB_PP_ONE_WAY=1 "$b/pp_sendrecv_perf" -b 4K -e 1G -f 4 -c 1 -n 20 -w 3
      launch=("$mpi_home/bin/mpirun" -n 2) per_rank=(-g 1)
    fi
    ntrun nccl-sendrecv "$b/sendrecv_perf" -b 4K -e 1G -f 4 -c 1 -n 20 -w 3
    ntrun engram-check UNIFAB_ENGRAM_ROW_BYTES=14336 "$b/engram_read_perf" -b 14K -e 224M -f 4 -c 1 -n 20 -w 3
    for row in 4096 14336 65536; do
      ntrun "engram-random-$row" UNIFAB_ENGRAM_ROW_BYTES=$row UNIFAB_ENGRAM_RANDOM=1 "$b/engram_read_perf" -b 64M -e 64M -c 0 -n 20 -w 3
    done
    ntrun moe-dispatch-check UNIFAB_EP_ROUTING=1 "$b/moe_dispatch_perf" -b 14K -e 56M -f 8 -c 1 -n 5 -w 2
    ntrun moe-combine-check UNIFAB_EP_ROUTING=1 "$b/moe_combine_perf" -d bfloat16 -b 14K -e 56M -f 8 -c 1 -n 5 -w 2
    ntrun moe-dispatch-graph UNIFAB_EP_ROUTING=1 "$b/moe_dispatch_perf" -b 56M -e 56M -c 1 -G 10 -n 30 -w 5
    ntrun moe-dispatch-bf16 "$b/moe_dispatch_perf" -b 56M -e 56M -c 0 -n 30 -w 5
    ntrun moe-dispatch-fp8 UNIFAB_EP_FP8=1 "$b/moe_dispatch_perf" -b 28M -e 28M -c 0 -n 30 -w 5
    ntrun moe-combine-bf16 "$b/moe_combine_perf" -d bfloat16 -b 56M -e 56M -c 0 -n 30 -w 5
    ntrun moe-combine-input-check UNIFAB_EP_ROUTING=1 UNIFAB_EP_COMBINE_INPUT=1 "$b/moe_combine_perf" -d bfloat16 -b 14K -e 56M -f 8 -c 1 -n 5 -w 2
    ntrun moe-combine-input UNIFAB_EP_COMBINE_INPUT=1 "$b/moe_combine_perf" -d bfloat16 -b 56M -e 56M -c 0 -n 30 -w 5
    ntrun moe-ll-dispatch UNIFAB_EP_MODE=1 "$b/moe_dispatch_perf" -b 1792K -e 1792K -c 0 -n 50 -w 10
    ;;
  ntcompare)
    # nccl-tests against unifab-bench on the same shapes, interleaved, UNIFAB_NTCOMPARE_REPS times
    # (UNIFAB_NTCOMPARE_HOST_REPS for the host-bound rows): each repetition runs every test once in
    # each tool, a process (pair) each.
    # nccl-tests times each size 5 times (-N 5), each the slowest rank's (-a 3, as unifab-bench
    # reduces); unifab-bench's back-to-back time is the median of 5 runs of as many calls as
    # nccl-tests' -n. Calls whose time is the host's or a hand-over's (PP up to 4 MiB, Engram's
    # copy engine) vary by 10-20 % from one run of 20 calls to the next on these shared machines:
    # those rows take 200 calls a run on both sides, and Engram's copy engine 100 warm-up fetches in
    # nccl-tests (its first ~100 ms of fetches ran up to 2x slower in every process). Whole
    # processes also land in a slow mode (Engram's 64 KiB fetch: 540-600 us in some, ~1000 in
    # others, on both sides alike), so tests/bench/nccltests_compare.py checks the 5 % on the
    # medians over many repetitions and prints each tool's fastest next to them.
    nccl_tests_setup || continue
    # 5 repetitions for the GPU-bound rows, 10 for the host-bound ones (PP up to 4 MiB, Engram's
    # copy engine), whose medians need them (docs/benchmarks/nccl-tests.md); ~4.5 minutes in all.
    # unifab-bench pp and engram run the compared engine alone (--engines): in call 3 of the fifteenth
    # session unifab-bench pp, timing NCCL and the copy engine in the same process, ran 6-12 % slower
    # than nccl-tests at every size to 4 MiB (medians of 10; the fastest runs 1-5 %).
    reps=${UNIFAB_NTCOMPARE_REPS:-5}
    host_reps=${UNIFAB_NTCOMPARE_HOST_REPS:-10}
    # Across processes PP runs on the slots engine (nccl-tests' ncclMemAlloc buffers; see nccltests).
    pp_engine=rendezvous
    [ -n "$mpi_home" ] && pp_engine=slots
    say "== nccl-tests against unifab-bench, interleaved, $reps repetitions ($host_reps for the host-bound rows; ${launch[*]:-threads}; PP engine $pp_engine)"
    # UNIFAB_NTCOMPARE_CPUS (CPUs or ranges, comma-separated, e.g. 0-7,8-15): rank r of both tools
    # runs on the r-th item (unifab-launch's UNIFAB_RANK_CPUS; tests/bench/bind_rank.sh under MPI),
    # to see whether the host-bound rows' spread between processes is where their threads land.
    # One CPU a rank (2,3; sixteenth session) made them worse and one-sided, unifab-bench 10-22 %
    # slower: every thread of a process then shares its CPU (docs/benchmarks/nccl-tests.md).
    cpus_env=() bind=()
    if [ -n "${UNIFAB_NTCOMPARE_CPUS:-}" ]; then
      cpus_env=(UNIFAB_RANK_CPUS="$UNIFAB_NTCOMPARE_CPUS")
      [ ${#launch[@]} -gt 0 ] && bind=("$here/tests/bench/bind_rank.sh")
      say "# both tools' rank r on CPU r of $UNIFAB_NTCOMPARE_CPUS"
    fi
    cmp_nt() {  # LABEL [NAME=VALUE]... BINARY ARGS...
      local label=$1; shift
      local envs=()
      while [[ "$1" == *=* ]]; do envs+=("$1"); shift; done
      logged "$logs/nt-cmp-$label.txt" "${launch[@]}" env ${cpus_env[@]+"${cpus_env[@]}"} "${envs[@]}" \
        ${bind[@]+"${bind[@]}"} "$@" -N 5 -a 3 "${per_rank[@]}"
    }
    cmp_bench() {  # LABEL [NAME=VALUE]... SUBCOMMAND ARGS... (of unifab-bench)
      local label=$1; shift
      local envs=()
      while [[ "$1" == *=* ]]; do envs+=("$1"); shift; done
      logged "$logs/cmp-$label.txt" env ${cpus_env[@]+"${cpus_env[@]}"} "${envs[@]}" "$bench" "$@" --csv "$logs/cmp-$label.csv"
    }
    pp=(UNIFAB_PP_ENGINE=$pp_engine)
    # UNIFAB_NTCOMPARE_TESTS: a subset of "pp-short pp-long engram engram-ce moe" (default all);
    # the comparison then leaves out the rows not run.
    parts=" ${UNIFAB_NTCOMPARE_TESTS:-pp-short pp-long engram engram-ce moe} "
    wants() { [[ "$parts" == *" $1 "* ]]; }
    for rep in $(seq 1 "$(( reps > host_reps ? reps : host_reps ))"); do
      if wants pp-short && [ "$rep" -le "$host_reps" ]; then
        cmp_nt "pp.short.rep$rep" "${pp[@]}" UNIFAB_PP_ONE_WAY=1 "$b/pp_sendrecv_perf" -b 4K -e 4M -f 4 -c 0 -n 200 -w 20
        cmp_bench "pp.short.rep$rep" "${pp[@]}" pp --min 4K --max 4M --factor 4 --iters 5 --warmup 3 --b2b 200 --engines unifab
      fi
      if wants pp-long && [ "$rep" -le "$reps" ]; then
        cmp_nt "pp.long.rep$rep" "${pp[@]}" UNIFAB_PP_ONE_WAY=1 "$b/pp_sendrecv_perf" -b 16M -e 1G -f 4 -c 0 -n 20 -w 3
        cmp_bench "pp.long.rep$rep" "${pp[@]}" pp --min 16M --max 1G --factor 4 --iters 5 --warmup 3 --engines unifab
      fi
      if wants engram && [ "$rep" -le "$reps" ]; then
        for row in 4096 14336; do  # the gather kernel on 4 SMs, what these rows are measured on
          cmp_nt "engram-$row.rep$rep" UNIFAB_ENGRAM_ROW_BYTES=$row UNIFAB_ENGRAM_RANDOM=1 UNIFAB_ENGRAM_ENGINE=2 \
            UNIFAB_ENGRAM_SMS=4 "$b/engram_read_perf" -b 64M -e 64M -c 0 -n 20 -w 3
        done
        cmp_bench "engram.rep$rep" engram --rows 4K,14K --fetch 64M --iters 5 --warmup 3 --engines gather
      fi
      if wants engram-ce && [ "$rep" -le "$host_reps" ]; then
        cmp_nt "engram-65536.rep$rep" UNIFAB_ENGRAM_ROW_BYTES=65536 UNIFAB_ENGRAM_RANDOM=1 UNIFAB_ENGRAM_ENGINE=1 \
          "$b/engram_read_perf" -b 64M -e 64M -c 0 -n 200 -w 100
        cmp_bench "engram.ce.rep$rep" engram --rows 64K --fetch 64M --iters 5 --warmup 3 --b2b 200 --engines copy
      fi
      if wants moe && [ "$rep" -le "$reps" ]; then
        cmp_nt "moe-dispatch-bf16.rep$rep" "$b/moe_dispatch_perf" -b 56M -e 56M -c 0 -n 20 -w 5
        cmp_nt "moe-dispatch-fp8.rep$rep" UNIFAB_EP_FP8=1 "$b/moe_dispatch_perf" -b 28M -e 28M -c 0 -n 20 -w 5
        cmp_nt "moe-combine-bf16.rep$rep" "$b/moe_combine_perf" -d bfloat16 -b 56M -e 56M -c 0 -n 20 -w 5
        cmp_nt "moe-combine-input.rep$rep" UNIFAB_EP_COMBINE_INPUT=1 "$b/moe_combine_perf" -d bfloat16 -b 56M -e 56M -c 0 -n 20 -w 5
        cmp_nt "moe-ll-dispatch.rep$rep" UNIFAB_EP_MODE=1 "$b/moe_dispatch_perf" -b 1792K -e 1792K -c 0 -n 20 -w 10
        cmp_bench "ep-ht-bf16.rep$rep" ep --mode ht --dtype bf16 --ops dispatch,combine,combine-input --iters 5 --warmup 5
        cmp_bench "ep-ht-fp8.rep$rep" ep --mode ht --dtype fp8 --ops dispatch --iters 5 --warmup 5
        cmp_bench "ep-ll-bf16.rep$rep" ep --mode ll --dtype bf16 --tokens 128 --ops dispatch --iters 10 --warmup 10 --kernel-times 0
      fi
    done
    python3 "$here/tests/bench/nccltests_compare.py" "$logs" ${UNIFAB_NTCOMPARE_TESTS:+--only-run} | tee -a "$summary"
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
    ;;
  tunesweep)
    # ~1.6 s per configuration run: 22 configurations x 3 repetitions is ~2 min per collective and
    # net, so a 10-minute device call takes a subset (UNIFAB_TUNESWEEP_NETS, UNIFAB_TUNESWEEP_OPS).
    # Configurations are forced through the tuner (a rule file each, --force tuner): what a tuner can choose;
    # --log-tuning adds what the tuner and NCCL chose per size (an untimed run each); over unifab
    # every rank is a node of its own (NCCL_HOSTID).
    say "== unifab-bench tune-sweep: forced NCCL configurations against the tuner and NCCL's default"
    # Loopback has no port speed in sysfs (unifab and NCCL would assume 10 Gbit/s); it carries
    # ~10 GB/s (docs/benchmarks/net-socket.md), which NCCL's default and the tuner are told alike.
    for net in ${UNIFAB_TUNESWEEP_NETS:-nvlink unifab}; do
      # Over the sockets NCCL builds 8 channels by default and more only slow every configuration
      # down (docs/benchmarks/tuner.md), so the forced ones run with NCCL's own 8 built.
      # tune-sweep times calls 20 to a CUDA graph where they are short (coll --batch): over NVLink that
      # took the ranks' skew and the host's enqueue out of the small sizes. Across nodes a graph
      # does not take the host out: NCCL hands each captured collective's network work to its proxy
      # through a host callback per replay (NVIDIA/nccl#1805), so graphs would time those callbacks,
      # not what an eager call costs (the one such sweep ran out of its call's 600 s before its
      # first table, ninth session). Over the sockets calls last 20 us and more: single calls there.
      # NVLink: 24 is what NCCL builds by default on 2 x H200, for the acceptance at that build.
      # Sizes as the tuner issue asks, x4 steps up to 1 GiB (16 B: the smallest all_gather of whole
      # floats on 2 ranks that x4 steps take to 1 GiB); over the sockets to 256 MiB, where one
      # configuration's 1 GiB calls alone would take minutes.
      speed="" channels=8,24,32 sizes="--min 16 --max 1G --factor 4"
      [ "$net" = unifab ] && speed="--socket-speed-mbps 80000" channels=1,2,8 sizes="--min 16 --max 256M --factor 4"
      channels=${UNIFAB_TUNESWEEP_CHANNELS:-$channels}
      sizes=${UNIFAB_TUNESWEEP_SIZES:-$sizes}
      sweep=(--net $net --ops "${UNIFAB_TUNESWEEP_OPS:-all_reduce,all_gather,reduce_scatter,broadcast}" $sizes
             --reps "${UNIFAB_TUNESWEEP_REPS:-3}" --channels $channels --log-tuning --out "$logs/tune-sweep-$net")
      "$bench" tune-sweep "${sweep[@]}" --iters 20 --warmup 5 $speed >"$logs/tune-sweep-$net.txt" 2>&1 || failed=1
      grep -E "^#|^  " "$logs/tune-sweep-$net.txt" | tee -a "$summary"
      # Whole processes land in a fast or a slow mode 15-25 % apart (docs/benchmarks/tuner.md, eighth
      # run): the same sweep again with each configuration's fastest repetition, from its logs.
      say "== the same sweep, fastest of the repetitions (--from-logs --rep-stat min)"
      # The ranks the sweep ran, from its CSVs' ranks column (what cudaGetDeviceCount gave it).
      ranks=$(awk -F, 'FNR == 2 { print $2; exit }' "$logs/tune-sweep-$net"/*.rep1.csv 2>/dev/null)
      "$bench" tune-sweep "${sweep[@]}" --from-logs --nranks "${ranks:-0}" --rep-stat min \
        >"$logs/tune-sweep-$net-min.txt" 2>&1 || failed=1
      grep -E "^# [a-z_]+ over|^# \(fastest|^# +bytes|^# acceptance|^# worst|^# at the|^# where|^ +[0-9]+ [A-Z]" \
        "$logs/tune-sweep-$net-min.txt" |
        tee -a "$summary"
    done
    ;;
  epsweep)
    say "== unifab-bench ep --mode ht, SM sweep (dispatch, cached dispatch, combine)"
    for dtype in bf16 fp8; do
      for sms in 8 12 16 20 24 32; do
        "$bench" ep --mode ht --dtype $dtype --sms $sms --ops dispatch,cached,combine --iters 30 --warmup 5 \
          --csv "$logs/ep-sweep-$dtype-$sms.csv" >"$logs/ep-sweep-$dtype-$sms.txt" 2>&1 || failed=1
        grep -E "^  (dispatch|combine)" "$logs/ep-sweep-$dtype-$sms.txt" | sed "s/^/$dtype $sms SMs: /" | tee -a "$summary"
      done
    done
    say "== combine at 24 SMs by sender blocks (UNIFAB_EP_COMBINE_SENDERS; the tuner's split is 9)"
    for senders in 7 8 9 10 11 12; do
      UNIFAB_EP_COMBINE_SENDERS=$senders "$bench" ep --mode ht --dtype bf16 --sms 24 --ops combine --iters 30 --warmup 5 \
        >"$logs/ep-senders-$senders.txt" 2>&1 || failed=1
      grep -E "^  combine" "$logs/ep-senders-$senders.txt" | sed "s/^/$senders senders: /" | tee -a "$summary"
    done
    ;;
  trace)
    say "== UNIFAB_EP_TRACE=1: phase ends per op alone (means over every call, warm-up included)"
    for dtype in ${UNIFAB_TRACE_DTYPES:-bf16 fp8}; do
      for ops in ${UNIFAB_TRACE_OPS:-empty cached dispatch combine}; do
        UNIFAB_EP_TRACE=1 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT "$bench" ep --mode ht --dtype $dtype --ops $ops \
          --iters 30 --warmup 5 >"$logs/ep-trace-$dtype-$ops.txt" 2>&1 || failed=1
        grep -E "^  (dispatch|combine)" "$logs/ep-trace-$dtype-$ops.txt" | sed "s/^/$dtype $ops: /" | tee -a "$summary"
        grep -o -E "EP trace rank [0-9]+: .*" "$logs/ep-trace-$dtype-$ops.txt" | grep -v "mean of 0)" | sed "s/^/  /" | tee -a "$summary"
      done
    done
    ;;
  lltrace)
    # Each low-latency combine call follows a full dispatch, so one run traces both operations.
    # UNIFAB_LLTRACE_DTYPE picks the dispatch's dtype (default fp8).
    trace_dtype="${UNIFAB_LLTRACE_DTYPE:-fp8}"
    say "== UNIFAB_EP_TRACE=1: low-latency phase ends (${trace_dtype^^} dispatch, BF16 combine; every call, warm-up included)"
    # UNIFAB_LLTRACE_OPS (default combine; pair: the combine right after its dispatch, no flush between).
    for trace_op in ${UNIFAB_LLTRACE_OPS:-combine}; do
      for tokens in ${UNIFAB_LLTRACE_TOKENS:-1 128}; do
        trace_log="$logs/ep-lltrace-$trace_op-$tokens.txt"
        say "-- $trace_op, $tokens tokens"
        UNIFAB_EP_TRACE=1 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT "$bench" ep --mode ll --dtype "$trace_dtype" --tokens "$tokens" \
          --ops "$trace_op" --iters 50 --warmup 10 ${UNIFAB_LLTRACE_ARGS:-} >"$trace_log" 2>&1 || failed=1
        grep -E "^ +[0-9]+ +[a-z]" "$trace_log" | tee -a "$summary"
        grep -o -E "EP trace rank [0-9]+: LL.*" "$trace_log" | sort | sed "s/^/  /" | tee -a "$summary"
      done
    done
    ;;
  llncu)
    # One rank, whose group sends to itself, so that Nsight Compute's kernel replay finds the data
    # it waits for (two ranks would wait for a peer that does not replay). The CSV lists each SASS
    # instruction of the kernel with its sampled stall reasons.
    kernel="${UNIFAB_LLNCU_KERNEL:-llDispatchKernel}"
    say "== ncu: $kernel, 1 rank, ${UNIFAB_LLNCU_TOKENS:-1} tokens, FP8 dispatch"
    timeout -k 10 300 ncu --clock-control none --cache-control none --section SourceCounters --section WarpStateStats \
      --section LaunchStats --warp-sampling-interval 0 -k "regex:$kernel" --launch-skip 20 --launch-count ${UNIFAB_LLNCU_LAUNCHES:-10} -f -o "$logs/llncu" \
      "$bench" ep --mode ll --nranks 1 --dtype fp8 --tokens "${UNIFAB_LLNCU_TOKENS:-1}" --ops dispatch,combine \
      --iters 30 --warmup 10 --kernel-times 0 >"$logs/llncu.txt" 2>&1 || failed=1
    ncu --import "$logs/llncu.ncu-rep" --page details >"$out/llncu-details.txt" 2>&1 || failed=1
    # Per SASS instruction, summed over the launches (ncu's CUDA-line view of this CSV carries no
    # metrics; map addresses to lines with nvdisasm --print-line-info on the -lineinfo build).
    ncu --import "$logs/llncu.ncu-rep" --page source --csv --print-source sass >"$logs/llncu-sass.csv" 2>&1 &&
      python3 "$here/tests/bench/ncu_stalls.py" "$logs/llncu-sass.csv" >"$out/llncu-sass.txt" 2>&1 || failed=1
    tail -5 "$logs/llncu.txt" | tee -a "$summary"
    grep -E "Warp Cycles|Stall|Duration|Registers|Threads" "$out/llncu-details.txt" | head -30 | tee -a "$summary"
    ;;
  sanitize)
    # Small shape, long device timeouts (the sanitizer slows kernels, and the two ranks wait on
    # each other), but each run bounded by UNIFAB_SANITIZE_LIMIT_S (default 150 s; a run takes
    # 20-60 s) so that a hang under a tool cannot spend the whole device call.
    limit="${UNIFAB_SANITIZE_LIMIT_S:-150}"
    # Two ranks where there are two GPUs; on a one-GPU machine one rank, whose group sends to itself.
    ranks=$(nvidia-smi -L 2>/dev/null | wc -l); [ "$ranks" -gt 2 ] && ranks=2; [ "$ranks" -lt 1 ] && ranks=1
    for test in ${UNIFAB_SANITIZE_TESTS:-ht ll}; do
      for tool in memcheck racecheck; do
        say "== compute-sanitizer --tool $tool, EP $test test, $ranks rank(s), --quick"
        started=$(date +%s)
        UNIFAB_EP_TIMEOUT_MS=$(( limit * 1000 / 2 )) timeout -k 10 "$limit" \
          compute-sanitizer --tool $tool --target-processes all --report-api-errors no --error-exitcode 9 \
          "$build/tests/unifab-launch" -n "$ranks" -t "$limit" -- "$build/tests/gpu/unifab_gpu_ep_$test" --quick --iterations 3 --replays 1 \
          >"$logs/sanitize-$test-$tool.txt" 2>&1
        rc=$?
        [ $rc -ne 0 ] && failed=1
        grep -E "ERROR SUMMARY|passed, [0-9]+ failed|Error|error" "$logs/sanitize-$test-$tool.txt" | sort | uniq -c | head -20 | tee -a "$summary"
        if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
          say "TIMED OUT after $(( $(date +%s) - started )) s (UNIFAB_SANITIZE_LIMIT_S=$limit); the log's last lines:"
          tail -15 "$logs/sanitize-$test-$tool.txt" | tee -a "$summary"
        fi
        pack
      done
    done
    ;;
  sweep)
    say "== socket transport settings, all_reduce over unifab"
    compare 3 "--net unifab --op all_reduce --min 4 --max 64M --factor 16 --iters 20 --warmup 3" \
      -- auto -- t4 UNIFAB_SOCKET_NTHREADS=4 -- t4-nopoll UNIFAB_SOCKET_NTHREADS=4 UNIFAB_SOCKET_BUSY_POLL_US=0 \
      -- t2-nopoll UNIFAB_SOCKET_NTHREADS=2 UNIFAB_SOCKET_BUSY_POLL_US=0 \
      -- t4-chunk512k UNIFAB_SOCKET_NTHREADS=4 UNIFAB_SOCKET_CHUNK_BYTES=512K \
      -- t8-nopoll UNIFAB_SOCKET_BUSY_POLL_US=0 -- s2t4 UNIFAB_SOCKET_NSTREAMS=2 UNIFAB_SOCKET_NTHREADS=4 \
      -- t4-buf4m UNIFAB_SOCKET_NTHREADS=4 UNIFAB_SOCKET_BUFFER_BYTES=4M
    ;;
  ab)
    # A change against its baseline on the same machine, interleaved: the working tree is the
    # change, and the baseline is the working tree with UNIFAB_AB_PATCH reversed (make it with
    # `git diff BASE > ab.patch` in the repository root; it is ignored by git, so name it in the
    # device call's carry list).
    # Several baselines at once: UNIFAB_AB_PATCH="NAME=FILE NAME=FILE ..." (a bare FILE is named
    # base; ab-NAME.patch files are ignored by git too); each is the working tree with its patch
    # reversed, and all run interleaved.
    # The baselines build side by side (each a whole tree from scratch: in turn they would take
    # most of a device call). UNIFAB_AB_TEST=CTEST_NAME also builds and runs that gpu test on each
    # baseline before any timing, so that a variant which breaks the data is not timed as faster.
    variants=()
    prepared=()
    ab_test="${UNIFAB_AB_TEST:-}"
    # With a test to run, each baseline builds everything (the test's executable among it).
    ab_targets=(--target unifab-bench)
    [ -n "$ab_test" ] && ab_targets=()
    for spec in ${UNIFAB_AB_PATCH:-$here/ab.patch}; do
      name=base; patch_file="$spec"
      [[ "$spec" == *=* ]] && { name="${spec%%=*}"; patch_file="${spec#*=}"; }
      [[ "$patch_file" == /* ]] || patch_file="$here/$patch_file"
      if [[ " ${prepared[*]} " == *" $name "* ]]; then
        say "ab: two baselines named $name: name each (NAME=FILE)"; failed=1; continue
      fi
      base_src="/tmp/unifab-ab-$name"
      rm -rf "$base_src" && mkdir -p "$base_src"
      (cd "$here" && tar --exclude='./build*' --exclude='./gpu-results' -cf - .) | tar -xf - -C "$base_src"
      if ! (cd "$base_src" && patch -R -p1 -s <"$patch_file") >"$logs/ab-patch-$name.log" 2>&1; then
        say "ab: $patch_file does not reverse-apply to this tree"; cat "$logs/ab-patch-$name.log"; failed=1; continue
      fi
      prepared+=("$name")
    done
    jobs_each=$(( $(nproc) / (${#prepared[@]} > 0 ? ${#prepared[@]} : 1) )); [ "$jobs_each" -lt 2 ] && jobs_each=2
    for name in "${prepared[@]}"; do
      base_src="/tmp/unifab-ab-$name"
      { configure "$base_src" "$base_src/build" &&
          cmake --build "$base_src/build" -j "$jobs_each" ${ab_targets[@]+"${ab_targets[@]}"}; } >"$logs/ab-build-$name.log" 2>&1 &
    done
    wait
    for name in "${prepared[@]}"; do
      base_src="/tmp/unifab-ab-$name"
      if [ ! -x "$base_src/build/tests/bench/unifab-bench" ]; then
        say "ab: the baseline $name does not build"; tail -20 "$logs/ab-build-$name.log"; failed=1; continue
      fi
      if [ -n "$ab_test" ]; then
        (cd "$base_src/build" && timeout 300 ctest --no-tests=error -R "^$ab_test\$" --output-on-failure) >"$logs/ab-test-$name.log" 2>&1
        test_status=$?
        say "ab: $ab_test on $name: $(grep -E 'tests passed|tests failed' "$logs/ab-test-$name.log" | tail -1) (exit $test_status)"
        if [ $test_status -ne 0 ]; then tail -30 "$logs/ab-test-$name.log"; failed=1; continue; fi
      fi
      variants+=("$name")
    done
    [ ${#variants[@]} -eq 0 ] && { pack; continue; }
    ab_args="${UNIFAB_AB_ARGS:-ep --mode ht --sms 24 --ops dispatch,cached,empty --iters 30 --warmup 5}"
    say "== ab: $ab_args, baselines (${variants[*]}: patch reversed) and change, interleaved, ${UNIFAB_AB_REPS:-3} repetitions"
    for rep in $(seq 1 "${UNIFAB_AB_REPS:-3}"); do
      for dtype in ${UNIFAB_AB_DTYPES:-fp8 bf16}; do
        for side in "${variants[@]}" change; do
          binary="$bench"; [ "$side" != change ] && binary="/tmp/unifab-ab-$side/build/tests/bench/unifab-bench"
          dtype_args=(--dtype "$dtype"); [ "$dtype" = - ] && dtype_args=()  # "-": a benchmark without dtypes
          timeout 120 "$binary" $ab_args "${dtype_args[@]}" >"$logs/ab-$side-$dtype-$rep.txt" 2>&1 || failed=1
          grep -E "^ +([0-9]+ +)?[a-z]" "$logs/ab-$side-$dtype-$rep.txt" | sed "s/^/$side $dtype rep $rep:/" | tee -a "$summary"
        done
      done
    done
    # UNIFAB_AB_COLUMNS: which numbers after the op to table (default 1, the time; the low-latency
    # benchmark's kernel time is 6).
    for column in ${UNIFAB_AB_COLUMNS:-1}; do
      python3 "$here/tests/bench/ab_table.py" "$summary" "$column" >"$logs/ab-table-$column.txt" &&
        tee -a "$summary" <"$logs/ab-table-$column.txt"
    done
    ;;
  *) echo "unknown step $step"; failed=1 ;;
  esac
  pack
done
exit $failed
