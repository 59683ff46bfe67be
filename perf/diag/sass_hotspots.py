"""The SASS instructions a kernel's warps stall on most, from Nsight Compute's source page: stall
samples summed by opcode, then the top instructions with their share of all samples."""

#     ncu --section SourceCounters -k regex:paged_attention -o report ... python3 ...
#     ncu -i report.ncu-rep --page source --print-source sass --csv > sass.csv
#     python3 perf/diag/sass_hotspots.py sass.csv [--top 30]
#
# (perf/run_gpu.sh's hotspots-attention step.) Without a stall-sampling column it prints the CSV's
# header, so a renamed column shows up instead of an empty report.

from __future__ import annotations

import argparse
import collections
import csv


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    with open(args.csv, newline="") as f:
        rows = list(csv.reader(f))
    header_at = next((i for i, row in enumerate(rows) if "Source" in row and "Address" in row), None)
    if header_at is None:
        print("no source table; first lines:", rows[:3])
        return
    header = rows[header_at]
    stall = next((i for i, name in enumerate(header) if name.startswith("Warp Stall Sampling (All")), None)
    if stall is None:
        print("no stall-sampling column; header:", header)
        return
    source = header.index("Source")
    body = [row for row in rows[header_at + 1:] if len(row) == len(header) and row[source].strip()]
    total = sum(_number(row[stall]) for row in body) or 1.0
    by_opcode = collections.Counter()
    for row in body:
        words = row[source].split()
        opcode = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]  # past a predicate
        by_opcode[opcode.split(".")[0]] += _number(row[stall])
    print(f"{header[stall]}: {total:.0f} samples over {len(body)} instructions")
    print("by opcode:", ", ".join(f"{op} {100 * n / total:.1f}%" for op, n in by_opcode.most_common(15)))
    print(f"top {args.top} instructions:")
    for row in sorted(body, key=lambda row: -_number(row[stall]))[:args.top]:
        print(f"  {100 * _number(row[stall]) / total:5.1f}%  {row[header.index('Address')]}  {row[source]}")


if __name__ == "__main__":
    main()
