#!/usr/bin/env python3
"""Tables unifab-bench coll CSV files: for each label, the per-size median over its repetitions
(LABEL.repN.csv, or LABEL.csv) of time and bus bandwidth, labels side by side.

usage: median_table.py LOG_DIR DESCRIPTION LABEL...
"""
import csv
import glob
import os
import statistics
import sys


def load(logs, label):
    per_size = {}
    paths = sorted(glob.glob(os.path.join(logs, label + ".rep*.csv"))) or [os.path.join(logs, label + ".csv")]
    for path in paths:
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for row in csv.DictReader(f):
                per_size.setdefault(int(row["bytes"]), []).append((float(row["time_us"]), float(row["busbw_gbs"])))
    return {size: (statistics.median(t for t, _ in v), statistics.median(b for _, b in v), len(v))
            for size, v in per_size.items()}


def main():
    logs, what, labels = sys.argv[1], sys.argv[2], sys.argv[3:]
    runs = {label: load(logs, label) for label in labels}
    labels = [label for label in labels if runs[label]]
    sizes = sorted({size for run in runs.values() for size in run})
    reps = max((n for run in runs.values() for _, _, n in run.values()), default=0)
    print("%s -- time (us) / busbw (GB/s), median over %d repetition(s) of each run's median (slowest rank)"
          % (what, reps))
    print("%11s " % "bytes" + "".join("%22s" % label for label in labels))
    for size in sizes:
        cells = ["%.1f / %.2f" % runs[label][size][:2] if size in runs[label] else "-" for label in labels]
        print("%11d " % size + "".join("%22s" % cell for cell in cells))


if __name__ == "__main__":
    main()
