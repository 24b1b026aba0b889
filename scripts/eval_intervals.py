#!/usr/bin/env python3
"""Per-evaluation test accuracy of `qsr compare` runs against data parallel's 95% interval.

Usage: scripts/eval_intervals.py DP_COMPARE_DIR LABEL=RUN_PREFIX [LABEL=RUN_PREFIX ...]
where DP_COMPARE_DIR holds `dp-seed<N>/metrics.jsonl` and each RUN_PREFIX names runs
`RUN_PREFIX-seed<N>/metrics.jsonl` (e.g. `qsr=runs/compare-s4d2/qsr`). Prints a Markdown table: the
mean over seeds at each evaluation, marked "(below)" where it is under data parallel's interval.
"""
import glob
import json
import statistics
import sys

# Student's t, two-sided 95%, by degrees of freedom (seeds - 1), as `qsr compare` uses.
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def accuracies(prefix):
    runs = []
    for path in sorted(glob.glob(f"{prefix}-seed[0-9]*/metrics.jsonl")):
        with open(path) as f:
            records = [json.loads(line) for line in f]
        runs.append([r["accuracy"] for r in records if r["kind"] == "eval"])
    if not runs:
        sys.exit(f"no runs {prefix}-seed*/metrics.jsonl")
    return runs


def interval(xs):
    mean = statistics.mean(xs)
    half = T95[len(xs) - 1] * statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else 0.0
    return mean, half


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    dp = accuracies(f"{sys.argv[1]}/dp")
    n = min(len(r) for r in dp)
    print("| rule | " + " | ".join(f"eval {i + 1}" for i in range(n)) + " |")
    print("|---|" + "---|" * n)
    cells = [interval([r[i] for r in dp]) for i in range(n)]
    print("| data parallel | " + " | ".join(f"{m * 100:.2f} ± {h * 100:.2f}" for m, h in cells) + " |")
    for arg in sys.argv[2:]:
        label, prefix = arg.split("=", 1)
        runs = accuracies(prefix)
        row = []
        for i, (dm, dh) in enumerate(cells):
            m, _ = interval([r[i] for r in runs])
            row.append(f"{m * 100:.2f}" + ("" if m >= dm - dh else " (below)"))
        print(f"| {label} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
