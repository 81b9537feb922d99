"""Summarize Nsight Compute's source view: per kernel, the warp-stall reasons over all samples and the SASS
instructions with the most samples (offsets from the kernel's first instruction, as cuobjdump -sass prints).

    ncu ... --section SourceCounters --section WarpStateStats --export /tmp/r python3 ...
    ncu --import /tmp/r.ncu-rep --page source --csv --print-source sass > source.csv
    python3 benchmarks/ncu_source_summary.py source.csv [--kernel pre_kernel] [--top 30] [--ranges 0-6800,8310-b020]

``--ranges``: also the reasons and the top instructions of each range of offsets (hex, end excluded), e.g. the roles
of a warp-specialized kernel as its SASS lays them out.
"""

from __future__ import annotations

import argparse
import collections
import csv


def kernels(path: str) -> list[dict]:
    """The CSV's kernels: ``{"name", "header", "rows"}`` each (the file repeats a header per kernel)."""
    out: list[dict] = []
    for row in csv.reader(open(path, newline="")):
        if row and row[0] == "Kernel Name":
            out.append({"name": row[1] if len(row) > 1 else "?", "header": None, "rows": []})
        elif out and row and row[0] == "Address":
            out[-1]["header"] = row
        elif out and out[-1]["header"] and len(row) == len(out[-1]["header"]):
            out[-1]["rows"].append(row)
    return out


def sites(k: dict) -> list[tuple]:
    """``(samples, offset, source, {reason: samples})`` of each instruction (offset from the kernel's first)."""
    h = k["header"]
    ix = {n: i for i, n in enumerate(h)}
    reasons = [n for n in h if n.startswith("stall_") and "Not Issued" not in n]
    base = int(k["rows"][0][ix["Address"]], 16)
    return [(float(r[ix["# Samples"]] or 0), int(r[ix["Address"]], 16) - base, r[ix["Source"]].strip(),
             {n[6:]: float(r[ix[n]] or 0) for n in reasons}) for r in k["rows"]]


def summary(title: str, rows: list[tuple], top: int) -> str:
    totals: collections.Counter = collections.Counter()
    for site in rows:
        totals.update(site[3])
    n = sum(site[0] for site in rows) or 1.0
    lines = [f"== {title}: {n:.0f} samples",
             "   reasons: " + ", ".join(f"{a} {v / n:.1%}" for a, v in totals.most_common(10))]
    for cnt, off, src, st in sorted(rows, key=lambda s: -s[0])[:top]:
        why = ", ".join(f"{a} {v:.0f}" for a, v in sorted(st.items(), key=lambda kv: -kv[1])[:3] if v)
        lines.append(f"   {cnt:6.0f} {cnt / n:5.1%} {off:05x}  {src[:64]:64} {why}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--kernel", default="", help="only kernels whose name contains this")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--ranges", default="", help="comma-separated hex offset ranges START-END to summarize apart")
    a = ap.parse_args()
    ranges = [tuple(int(x, 16) for x in part.split("-")) for part in a.ranges.split(",") if part]
    for k in kernels(a.csv):
        if a.kernel in k["name"] and k["rows"]:
            rows = sites(k)
            print(summary(k["name"][:80], rows, a.top))
            for lo, hi in ranges:
                print(summary(f"offsets {lo:05x}-{hi:05x}", [r for r in rows if lo <= r[1] < hi], a.top))


if __name__ == "__main__":
    main()
