#!/usr/bin/env bash
# nccltests_compare.py on made-up logs (no GPU): nccl-tests' cycles and repetitions are reduced by
# their median, op names with commas are read whole, a row past 5 % or without a measurement fails
# the comparison, and rows within it pass.
set -u
script="$1"
work=$(mktemp -d)
trap "rm -rf \"$work\"" EXIT
failures=0

# nt NAME REP SIZE US...: an nccl-tests log with one result line per cycle (out of place US, in
# place 1.0, which must not count).
nt() {
  local name=$1 rep=$2 size=$3
  shift 3
  {
    echo "#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong "
    for us in "$@"; do
      printf '%12s  %12s     float    none      -1  %7s    1.00    1.00    N/A     1.00    1.00    1.00    N/A\n' "$size" $((size / 4)) "$us"
    done
    echo "# Avg bus bandwidth    : 1.0 "
  } >"$dir/nt-cmp-$name.rep$rep.txt"
}

# write_all DIR PP_4K_BENCH_US ENGRAM_64K_NT_US: every pair of the script, the rest 100 us on both
# sides; PP 4 KiB's unifab-bench side and Engram 64 KiB's nccl-tests side as given.
write_all() {
  dir=$1
  local pp4k=$2 engram64=$3 rep size
  for rep in 1 2 3; do
    nt moe-dispatch-bf16 $rep 58720256 100 100 100 100 100
    nt moe-dispatch-fp8 $rep 29360128 100 100 100 100 100
    nt moe-combine-bf16 $rep 58720256 100 100 100 100 100
    nt moe-combine-input $rep 58720256 100 100 100 100 100
    nt moe-ll-dispatch $rep 1835008 100 100 100 100 100
    nt engram-4096 $rep 67108864 100 100 100 100 100
    nt engram-14336 $rep 67108864 100 100 100 100 100
    # One slow cycle per repetition: the median ignores it.
    nt engram-65536 $rep 67108864 "$engram64" "$engram64" 900 "$engram64" "$engram64"
    {
      echo "#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong "
      for size in 4096 16384 65536 262144 1048576 4194304 16777216 67108864 268435456 1073741824; do
        printf '%12s  %12s     float    none      -1  %7s    1.00    1.00    0     1.00    1.00    1.00    N/A\n' $size $((size / 4)) 100
      done
    } >"$dir/nt-cmp-pp.rep$rep.txt"
    {
      echo "op,ranks,tokens,hidden,topk,experts,dtype,layout,sms,time_us,deepep_gbs,nvlink_gbs,b2b_us,host_us"
      echo "dispatch,2,4096,7168,8,256,bf16,rank,0,110.00,1,1,100.00,5.0"
      echo "dispatch, cached,2,4096,7168,8,256,bf16,rank,0,110.00,1,1,50.00,5.0"
      echo "combine,2,4096,7168,8,256,bf16,rank,0,110.00,1,1,100.00,5.0"
      echo "combine_input,2,4096,7168,8,256,bf16,rank,0,110.00,1,1,100.00,5.0"
    } >"$dir/cmp-ep-ht-bf16.rep$rep.csv"
    {
      echo "op,ranks,tokens,hidden,topk,experts,dtype,layout,sms,time_us,deepep_gbs,nvlink_gbs,b2b_us,host_us"
      echo "dispatch,2,4096,7168,8,256,fp8,rank,0,110.00,1,1,100.00,5.0"
    } >"$dir/cmp-ep-ht-fp8.rep$rep.csv"
    {
      echo "op,ranks,tokens,hidden,topk,experts,dtype,sms,time_us,p99_us,selection_gbs,host_us,kernel_us,kernel_p99_us,b2b_us"
      echo "dispatch,2,32,7168,8,256,bf16,0,20.00,21.00,1,5.0,0,0,70.00"
      echo "dispatch,2,128,7168,8,256,bf16,0,20.00,21.00,1,5.0,0,0,100.00"
    } >"$dir/cmp-ep-ll-bf16.rep$rep.csv"
    {
      echo "row_bytes,engine,sms,rows,time_us,mrows_per_s,gbs,b2b_us"
      echo "4096,gather kernel,1,16384,400.00,1,1,300.00"
      echo "4096,gather kernel,4,16384,110.00,1,1,100.00"
      echo "14336,gather kernel,4,4681,110.00,1,1,100.00"
    } >"$dir/cmp-engram.rep$rep.csv"
    # 64 KiB rows from a run of their own (a PART of the name), as run-gpu.sh ntcompare leaves them.
    {
      echo "row_bytes,engine,sms,rows,time_us,mrows_per_s,gbs,b2b_us"
      echo "65536,copy engine,0,1024,110.00,1,1,100.00"
      echo "65536,raw batch, one call,0,1024,110.00,1,1,10.00"
    } >"$dir/cmp-engram.ce.rep$rep.csv"
    # A run of another name that starts alike must not count.
    {
      echo "row_bytes,engine,sms,rows,time_us,mrows_per_s,gbs,b2b_us"
      echo "65536,copy engine,0,1024,110.00,1,1,1.00"
    } >"$dir/cmp-engramx.rep$rep.csv"
    {
      echo "bytes,unifab_us,unifab_gbs,nccl_us,nccl_gbs,copy_engine_us,copy_engine_gbs,unifab_b2b_us,nccl_b2b_us"
      for size in 4096 16384 65536 262144 1048576 4194304 16777216 67108864 268435456 1073741824; do
        us=100.00
        [ $size = 4096 ] && us=$pp4k
        echo "$size,110.00,1,10.00,1,10.00,1,$us,10.00"
      done
    } >"$dir/cmp-pp.rep$rep.csv"
  done
}

# expect NAME STATUS ARGS...: the script's exit status on the logs.
expect() {
  local name=$1 want=$2
  shift 2
  python3 "$script" "$@" >"$work/$name.out" 2>&1
  local got=$?
  if [ "$got" != "$want" ]; then
    echo "FAIL $name: exit $got, expected $want"; cat "$work/$name.out"; failures=$((failures + 1))
  else
    echo "ok   $name"
  fi
}

mkdir -p "$work/agree" "$work/pp-apart" "$work/missing"
write_all "$work/agree" 104.00 104
expect "within 5 %" 0 "$work/agree"
# Each run's median over its 5 cycles (one of them 900 us) is 104: 4.0 %.
grep -E "64 KiB rows, copy engine +3/3 +104.00 +100.00 +4.0%" "$work/within 5 %.out" >/dev/null ||
  { echo "FAIL: the 64 KiB row is not the median of its cycles"; cat "$work/within 5 %.out"; failures=$((failures + 1)); }
# "dispatch, cached" (50 us) must not be read as "dispatch" (100 us).
grep -E "moe_dispatch_perf BF16, 4096 tokens +3/3 +100.00 +100.00 +0.0%" "$work/within 5 %.out" >/dev/null ||
  { echo "FAIL: the BF16 dispatch row"; cat "$work/within 5 %.out"; failures=$((failures + 1)); }

# One run (process) of three in a slow mode on one side: the median over the runs is the others'.
mkdir -p "$work/slow-run"
write_all "$work/slow-run" 100.00 100
dir="$work/slow-run" nt engram-14336 2 67108864 190 190 190 190 190
expect "one run in a slow mode" 0 "$work/slow-run"
grep -E "14 KiB rows, gather kernel 4 SMs +3/3 +100.00 +100.00 +0.0% +100.00 +100.00 +0.0%" \
  "$work/one run in a slow mode.out" >/dev/null ||
  { echo "FAIL: the slow run's row"; cat "$work/one run in a slow mode.out"; failures=$((failures + 1)); }
# Two of three: the median is a slow run's, and the comparison fails.
dir="$work/slow-run" nt engram-14336 3 67108864 180 180 180 180 180
expect "two runs in a slow mode" 1 "$work/slow-run"
grep -E "14 KiB rows, gather kernel 4 SMs +3/3 +180.00 +100.00 +80.0% +100.00 +100.00 +0.0% +> 5 %" \
  "$work/two runs in a slow mode.out" >/dev/null ||
  { echo "FAIL: the slow runs' row"; cat "$work/two runs in a slow mode.out"; failures=$((failures + 1)); }

write_all "$work/pp-apart" 90.00 100
expect "PP 4 KiB 11 % apart" 1 "$work/pp-apart"
grep -E "pp_sendrecv_perf one way, 4 KiB .*11.1% .*> 5 %" "$work/PP 4 KiB 11 % apart.out" >/dev/null ||
  { echo "FAIL: the PP row is not flagged"; cat "$work/PP 4 KiB 11 % apart.out"; failures=$((failures + 1)); }
expect "PP 4 KiB 11 % apart, limit 12 %" 0 "$work/pp-apart" --max-gap 12

write_all "$work/missing" 100.00 100
rm "$work"/missing/cmp-engram.rep*.csv "$work"/missing/cmp-engram.ce.rep*.csv
expect "no unifab-bench engram run" 1 "$work/missing"

# A comparison that ran no Engram test on either side: missing without --only-run, left out with it.
mkdir -p "$work/subset"
write_all "$work/subset" 100.00 100
rm "$work"/subset/cmp-engram.* "$work"/subset/nt-cmp-engram-*
expect "Engram not run" 1 "$work/subset"
expect "Engram not run, --only-run" 0 "$work/subset" --only-run
grep -q "engram" "$work/Engram not run, --only-run.out" &&
  { echo "FAIL: rows not run are listed"; failures=$((failures + 1)); }

[ $failures -eq 0 ] && echo "all cases passed" || echo "$failures case(s) failed"
exit $((failures > 0))
