"""Where a kernel's warps stall, from ncu's per-instruction warp-state samples.

Record and export on the GPU machine (one partial-kernel launch of a graph replay):

    ncu --clock-control none -k regex:tree_partial --launch-skip 2 --launch-count 1 \\
        --section WarpStateStats --section SourceCounters --import-source no -o prof \\
        python3 tools/profile_step.py "few-shot b=20"
    ncu -i prof.ncu-rep --page source --csv --print-source sass > src.csv

then ``python3 tools/ncu_stalls.py src.csv [NAME=LO-HI ...]``: the share of all samples and
the top stall reasons per address range (hex offsets from the kernel's first instruction,
e.g. ``loop=2290-33f0``; read the loops off the backward branches it lists), and the most
sampled instructions.
"""
import csv
import io
import sys
from _usage import args


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    lines = open(sys.argv[1], errors="replace").read().splitlines()
    start = next(i for i, line in enumerate(lines) if '"Address"' in line)
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    key = "Warp Stall Sampling (All Samples)"
    reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    base = int(rows[0]["Address"], 16)
    for row in rows:
        row["offset"] = int(row["Address"], 16) - base
    total = sum(number(r[key]) for r in rows)
    print(f"{len(rows)} instructions, {total:g} samples")

    def share(selected: list[dict]) -> str:
        by_reason = {c[6:]: sum(number(r[c]) for r in selected) for c in reasons}
        top = sorted(by_reason.items(), key=lambda kv: -kv[1])[:5]
        own = sum(number(r[key]) for r in selected)
        return f"{own / total:6.1%}  " + " ".join(f"{k} {v / total:.1%}" for k, v in top)

    print("backward branches (target <- branch):", ", ".join(
        f"{int(r['Source'].split('0x')[-1].split()[0], 16) - base:x} <- {r['offset']:x}"
        for r in rows if "BRA" in r["Source"] and "0x" in r["Source"]
        and int(r["Source"].split("0x")[-1].split()[0], 16) - base < r["offset"]))
    for spec in sys.argv[2:]:
        name, span = spec.split("=")
        lo, hi = (int(x, 16) for x in span.split("-"))
        print(f"{name:16s} {share([r for r in rows if lo <= r['offset'] < hi])}")
    print(f"{'all':16s} {share(rows)}")
    for r in sorted(rows, key=lambda r: -number(r[key]))[:15]:
        print(f"{number(r[key]) / total:6.1%}  {r['offset']:6x}  {r['Source'].strip()[:60]}")


if __name__ == "__main__":
    args(__doc__)
    main()
