"""The SASS lines with the most warp-stall samples in an Nsight Compute source-page CSV
(``ncu --import R --page source --csv --print-source sass``): python3 top_stalls.py FILE [N]."""

import csv
import sys


def main() -> None:
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"#') or line.startswith('"Address'))
    rows = list(csv.DictReader(lines[start:]))
    sample_col = next(c for c in rows[0] if "Sampling" in c and "All" in c)
    print("columns:", [c for c in rows[0] if "Samp" in c or "Stall" in c][:8])
    total = sum(float(r[sample_col] or 0) for r in rows)
    for r in sorted(rows, key=lambda r: -float(r[sample_col] or 0))[:top]:
        share = 100 * float(r[sample_col] or 0) / max(total, 1)
        print(f"{share:5.1f}% {r.get('Address', r.get('#', '')):>8} {r['Source'][:90]}")


if __name__ == "__main__":
    main()
