#!/usr/bin/env python3
"""Tables the interleaved runs of `tests/run-gpu.sh ab`: per (dtype, tokens, op), the median time
over the repetitions of each side (the baselines, then the change) and each baseline's difference
from the change, from the summary lines "SIDE DTYPE rep N: [TOKENS] OP  TIME ...".

usage: ab_table.py SUMMARY [COLUMN]
  COLUMN: which of the numbers after the op to table, 1 (the default) the first; e.g. 6 for the
  low-latency benchmark's kernel time (time, p99, GB/s, b2b, host, kernel). Rows whose entry there
  is "-" (not measured) are left out.
"""
import re
import statistics
import sys

LINE = re.compile(r"^(\S+) (\S+) rep (\d+):\s+(?:(\d+) )?( *)(\S.*?)\s{2,}([\d.]+(?:\s.*)?)$")


def main():
    times = {}   # (dtype, tokens, op) -> side -> [us]
    sides = []
    parent = ""
    column = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    with open(sys.argv[1]) as f:
        for line in f:
            m = LINE.match(line.rstrip("\n"))
            if not m:
                continue
            side, dtype, _, tokens, indent, op, numbers = m.groups()
            fields = numbers.split()
            if len(fields) < column or fields[column - 1] == "-":
                continue
            us = fields[column - 1]
            # An indented op (a low-latency phase) belongs to the op above it.
            if indent:
                op = parent + ": " + op
            else:
                parent = op
            if side not in sides:
                sides.append(side)
            times.setdefault((dtype, tokens or "", op.strip()), {}).setdefault(side, []).append(float(us))
    if not times:
        return
    if "change" in sides:
        sides = [s for s in sides if s != "change"] + ["change"]
    print("# ab: median of column %d (us) over the repetitions; in brackets, the change minus that side" % column)
    print("# %-6s %6s %-32s " % ("dtype", "tokens", "op") + " ".join("%16s" % s for s in sides))
    for (dtype, tokens, op), by_side in times.items():
        change = statistics.median(by_side["change"]) if "change" in by_side else None
        cells = []
        for side in sides:
            if side not in by_side:
                cells.append("%16s" % "-")
                continue
            med = statistics.median(by_side[side])
            if side == "change" or change is None:
                cells.append("%16.2f" % med)
            else:
                cells.append("%16s" % ("%.2f [%+.2f]" % (med, change - med)))
        print("  %-6s %6s %-32s " % (dtype, tokens, op) + " ".join(cells))


if __name__ == "__main__":
    main()
