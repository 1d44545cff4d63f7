"""Issue 3's targets read off a benchmark's JSON (`mxgemm bench --json`): for each regime, the rows that meet it and
the ones that miss, with `mxgemm` auto's speedup over bf16 cuBLAS (or over Triton `dot_scaled`).

    python3 bench/targets.py bench/results/h200.json [--markdown]
"""

from __future__ import annotations

import argparse
import json

# (name, which rows, contender the speedup is over, backend column, target)
REGIMES = [
    ("M <= 16, N*K >= 32Mi", lambda r: r["M"] <= 16 and r["N"] * r["K"] >= 32 << 20, "bf16", "mxgemm", 1.7),
    ("M = 64-256", lambda r: 64 <= r["M"] <= 256, "bf16", "mxgemm", 1.4),
    ("M >= 2048", lambda r: r["M"] >= 2048, "bf16", "mxgemm", 1.45),
    ("exact triton, M >= 2048", lambda r: r["M"] >= 2048, "bf16", "triton", 0.85),
    ("every shape vs dot_scaled", lambda r: True, "dot_scaled", "mxgemm", 3.0),
]


def verdicts(rows: list[dict]) -> list[dict]:
    out = []
    for name, pick, base, col, target in REGIMES:
        ratios = [(r, r["us"][base] / r["us"][col]) for r in rows if pick(r) and r["us"].get(base) and r["us"].get(col)]
        misses = [f"{r.get('name', '')} {r['N']}x{r['K']} M={r['M']} {x:.2f}" for r, x in ratios if x < target]
        out.append({
            "regime": name,
            "target": target,
            "met": len(ratios) - len(misses),
            "rows": len(ratios),
            "min": min((x for _, x in ratios), default=None),
            "max": max((x for _, x in ratios), default=None),
            "misses": misses,
        })  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("json")
    parser.add_argument("--markdown", action="store_true", help="a Markdown table instead of plain lines")
    args = parser.parse_args()
    with open(args.json) as f:
        rows = json.load(f)["rows"]
    if args.markdown:
        print("| regime | target | met | range | misses |\n|---|---|---|---|---|")
    for v in verdicts(rows):
        span = f"{v['min']:.2f}-{v['max']:.2f}x" if v["rows"] else "-"
        if args.markdown:
            print(f"| {v['regime']} | {v['target']}x | {v['met']} of {v['rows']} | {span} | {'; '.join(v['misses'])} |")
        else:
            print(f"{v['regime']}: {v['met']} of {v['rows']} at {v['target']}x or more ({span})")
            for miss in v["misses"]:
                print(f"  miss: {miss}")


if __name__ == "__main__":
    main()
