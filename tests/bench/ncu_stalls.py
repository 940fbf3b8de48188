#!/usr/bin/env python3
"""Sums Nsight Compute's sampled warp stalls over every kernel result of a source-page CSV.

Input: `ncu --import R --page source --csv --print-source sass` (one block per profiled launch).
Output: the total by stall reason, then every instruction that ran or was sampled, in address
order: instructions executed (warp level), samples, its three main stall reasons, the SASS.
"""
import collections
import csv
import sys


def number(text):
    try:
        return int(float(text or 0))
    except ValueError:
        return 0


def main(path):
    lines = collections.OrderedDict()
    header, index, reasons = None, {}, []
    for row in csv.reader(open(path, newline="")):
        if not row or row[0] == "Kernel Name":
            continue
        if row[0] == "Address":
            header = row
            index = {name: i for i, name in enumerate(row)}
            reasons = [name for name in row if name.startswith("stall_") and "Not Issued" not in name]
            continue
        if header is None or len(row) < len(header):
            continue
        key = row[0]
        entry = lines.setdefault(key, {"source": row[index["Source"]], "samples": 0, "executed": 0,
                                       "stalls": collections.Counter()})
        entry["samples"] += number(row[index["Warp Stall Sampling (All Samples)"]])
        if "Instructions Executed" in index:
            entry["executed"] += number(row[index["Instructions Executed"]])
        for reason in reasons:
            entry["stalls"][reason[len("stall_"):]] += number(row[index[reason]])
    total = collections.Counter()
    for entry in lines.values():
        total.update(entry["stalls"])
    print(f"lines {len(lines)}, samples {sum(e['samples'] for e in lines.values())}")
    print("by reason:", ", ".join(f"{k} {v}" for k, v in total.most_common() if v))
    for key, entry in lines.items():
        if entry["executed"] or entry["samples"]:
            top = " ".join(f"{k}={v}" for k, v in entry["stalls"].most_common(3) if v)
            print(f"{key:>18} {entry['executed']:8d} {entry['samples']:6d} {top:44s} {entry['source'].strip()[:110]}")


if __name__ == "__main__":
    main(sys.argv[1])
