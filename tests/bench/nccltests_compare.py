#!/usr/bin/env python3
"""nccl-tests against unifab-bench on the same shapes (issue: the two must agree within 5 %).

`tests/run-gpu.sh ntcompare` runs, REPS times and interleaved, each nccl-tests binary of
nccl-tests-patches/ with `-N CYCLES -a 3` (every size timed CYCLES times, each the slowest rank's)
and the unifab-bench run that times the same operation back to back (`b2b`: as many calls in a
row as nccl-tests' -n, median of 5 such runs, slowest rank). This script pairs them: per row and repetition (one process
pair per tool), nccl-tests' median over its cycles of the out-of-place time and unifab-bench's b2b
time; then per tool the median over the repetitions; gap = |nccl-tests - unifab-bench| /
unifab-bench. Whole processes on these shared machines run in faster or slower modes, so the
medians need many repetitions where that shows (10 for PP up to 4 MiB and Engram's copy engine,
docs/benchmarks/nccl-tests.md); the fastest repetition of each tool is printed next to them.

usage: nccltests_compare.py LOGS [--max-gap PERCENT] [--only-run]
  LOGS holds nt-cmp-NAME[.PART].repR.txt (nccl-tests) and cmp-NAME[.PART].repR.csv (unifab-bench);
  PART splits one row set over runs of different lengths (e.g. more calls for the short ones).
Exit status 1 when a row is past --max-gap (default 5) or has no measurement on either side
(--only-run: rows with none on both sides, not run, are left out).
"""
import glob
import os
import re
import statistics
import sys

# nccl-tests' result line: size count type redop root, then time algbw busbw #wrong (out of place)
# and the same in place.
RESULT = re.compile(r"^\s+(\d+)\s+\d+\s+\S+\s+\S+\s+-?\d+\s+([\d.]+)\s")


def runs(logs, stem, ext):
    """STEM.repR.EXT and STEM.PART.repR.EXT (one run's sizes split over runs of different lengths)."""
    pattern = re.compile(r"^%s(\.[a-z0-9-]+)?\.rep\d+\.%s$" % (re.escape(stem), ext))
    return sorted(p for p in glob.glob(os.path.join(logs, stem + ".*")) if pattern.match(os.path.basename(p)))


def nccl_tests_times(logs, name):
    """{size: [[out-of-place us of each cycle] of each run (process)]}."""
    times = {}
    for path in runs(logs, "nt-cmp-" + name, "txt"):
        cycles = {}
        with open(path) as f:
            for line in f:
                m = RESULT.match(line)
                if m:
                    cycles.setdefault(int(m.group(1)), []).append(float(m.group(2)))
        for size, values in cycles.items():
            times.setdefault(size, []).append(values)
    return times


def csv_rows(path, text_column=0):
    """Rows of a unifab-bench CSV whose column `text_column` (an op's or engine's name) may hold
    commas: (name, {every other column: text})."""
    rows = []
    with open(path) as f:
        header = f.readline().strip().split(",")
        after = len(header) - text_column - 1
        for line in f:
            parts = line.strip().split(",")
            if len(parts) < len(header):
                continue
            fields = dict(zip(header[:text_column], parts[:text_column]))
            fields.update(zip(header[text_column + 1:], parts[len(parts) - after:]))
            rows.append((",".join(parts[text_column:len(parts) - after]), fields))
    return rows


def bench_values(logs, name, pick):
    """[value per repetition] of the rows `pick(text_fields, numbers)` selects in cmp-NAME.repR.csv."""
    values = []
    for path in runs(logs, "cmp-" + name, "csv"):
        for value in pick(path):
            if value > 0:
                values.append(value)
    return values


def ep_b2b(op, tokens=None):
    def pick(path):
        return [float(numbers["b2b_us"]) for name, numbers in csv_rows(path)
                if name == op and (tokens is None or int(numbers["tokens"]) == tokens)]
    return pick


def engram_b2b(row_bytes, engine, sms):
    def pick(path):
        return [float(fields["b2b_us"]) for name, fields in csv_rows(path, text_column=1)
                if int(fields["row_bytes"]) == row_bytes and name == engine and int(fields["sms"]) == sms]
    return pick


def pp_b2b(size):
    def pick(path):
        out = []
        with open(path) as f:
            header = f.readline().strip().split(",")
            for line in f:
                numbers = dict(zip(header, line.strip().split(",")))
                if numbers.get("bytes") and int(numbers["bytes"]) == size:
                    out.append(float(numbers["unifab_b2b_us"]))
        return out
    return pick


PP_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]

# (label, nccl-tests run, its size, unifab-bench run, row picker)
PAIRS = [
    ("moe_dispatch_perf BF16, 4096 tokens", "moe-dispatch-bf16", 56 << 20, "ep-ht-bf16", ep_b2b("dispatch")),
    ("moe_dispatch_perf FP8, 4096 tokens", "moe-dispatch-fp8", 28 << 20, "ep-ht-fp8", ep_b2b("dispatch")),
    ("moe_combine_perf, 4096 tokens", "moe-combine-bf16", 56 << 20, "ep-ht-bf16", ep_b2b("combine")),
    ("moe_combine_perf, combine input", "moe-combine-input", 56 << 20, "ep-ht-bf16", ep_b2b("combine_input")),
    ("moe_dispatch_perf low latency, 128 BF16 tokens", "moe-ll-dispatch", 1835008, "ep-ll-bf16", ep_b2b("dispatch", 128)),
    ("engram_read_perf 4 KiB rows, gather kernel 4 SMs", "engram-4096", 64 << 20, "engram", engram_b2b(4096, "gather kernel", 4)),
    ("engram_read_perf 14 KiB rows, gather kernel 4 SMs", "engram-14336", 64 << 20, "engram", engram_b2b(14336, "gather kernel", 4)),
    ("engram_read_perf 64 KiB rows, copy engine", "engram-65536", 64 << 20, "engram", engram_b2b(65536, "copy engine", 0)),
] + [("pp_sendrecv_perf one way, %s" % (
    "%d GiB" % (s >> 30) if s >= 1 << 30 else "%d MiB" % (s >> 20) if s >= 1 << 20 else "%d KiB" % (s >> 10)),
      "pp", s, "pp", pp_b2b(s)) for s in PP_SIZES]


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    logs = sys.argv[1]
    max_gap = 5.0
    only_run = "--only-run" in sys.argv
    if "--max-gap" in sys.argv:
        max_gap = float(sys.argv[sys.argv.index("--max-gap") + 1])
    print("# per run (process): nccl-tests' median over its cycles (out of place, slowest rank: -a 3), unifab-bench's")
    print("# back-to-back time; 'median' = the median over the runs (the check: gap = |nt - bench| / bench),")
    print("# 'fastest' = the fastest run's (for information)")
    print("# %-50s %6s %10s %10s %7s %10s %10s %7s" % ("row", "runs", "nt median", "bench med", "gap", "nt fast",
                                                    "bench fast", "gap"))
    worst = 0.0
    failed = False
    for label, nt_name, size, bench_name, pick in PAIRS:
        nt_runs = [statistics.median(cycles) for cycles in nccl_tests_times(logs, nt_name).get(size, [])]
        bench = bench_values(logs, bench_name, pick)
        if not nt_runs and not bench and only_run:
            continue  # a row this comparison did not run
        if not nt_runs or not bench:
            print("  %-50s %3d/%-2d %10s" % (label, len(nt_runs), len(bench), "MISSING"))
            failed = True
            continue
        mid = (statistics.median(nt_runs), statistics.median(bench))
        fast = (min(nt_runs), min(bench))
        gap = abs(mid[0] - mid[1]) / mid[1] * 100.0
        fast_gap = abs(fast[0] - fast[1]) / fast[1] * 100.0
        worst = max(worst, gap)
        mark = "" if gap <= max_gap else "  > %.0f %%" % max_gap
        failed = failed or gap > max_gap
        print("  %-50s %3d/%-2d %10.2f %10.2f %6.1f%% %10.2f %10.2f %6.1f%%%s" % (
            label, len(nt_runs), len(bench), mid[0], mid[1], gap, fast[0], fast[1], fast_gap, mark))
    print("# worst gap of the medians %.1f %% (limit %.0f %%): %s" % (worst, max_gap, "FAILED" if failed else "passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
