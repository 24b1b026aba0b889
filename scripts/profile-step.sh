#!/usr/bin/env bash
# Where one training step's CPU time goes, by kind of work: `perf record` over `qsr time-step`, then the
# flat profile's symbols summed into groups (matrix products, convolutions, copies, GELU's erf, exp,
# elementwise ops, the kernel, ...). Prints a markdown table of percentages of the samples.
#
#   bash scripts/profile-step.sh [QSR_BINARY] -- TIME-STEP-ARGS...
#   bash scripts/profile-step.sh target/release/qsr -- --model gpt --threads 1 --steps 6 --warmup 1
#
# Needs `perf` (Debian: linux-perf) and a `qsr` built with symbols (the release profile keeps line tables).
set -euo pipefail
QSR=${1:-target/release/qsr}
shift || true
[ "${1:-}" = -- ] && shift
data=$(mktemp /tmp/qsr-profile.XXXXXX)
trap 'rm -f "$data" "$data.txt"' EXIT
perf record -q -F 499 -o "$data" "$QSR" time-step "$@" >&2
perf report -i "$data" --no-children --sort symbol --stdio 2>/dev/null | grep -E '^ +[0-9.]+%' > "$data.txt"
python3 - "$data.txt" <<'PY'
import re, sys
groups = [
    ("matrix products (gemm)", r"gemm_"),
    ("fused ops (qsr_models::fused; their loops run inside pulp's dispatch)", r"qsr_models::fused|pulp::"),
    ("convolutions (flex conv, im2col)", r"burn_flex::ops::conv|FnMut<A> for &F>::call_mut"),
    ("copies and layout (memmove, strided copies)", r"memmove|copy_2d|memcpy|to_contiguous|permute"),
    ("zero fills (memset)", r"memset|filled"),
    ("GELU's erf (libm, scalar)", r"erff"),
    ("exp (softmax, log-softmax)", r"expf|exp_"),
    ("elementwise and reductions (flex)", r"burn_flex::ops::(binary|unary|reduce|activation)|burn_flex::zip|macerator|burn_flex::simd"),
    ("autodiff graph (burn-autodiff)", r"burn_autodiff"),
    ("allocator (malloc/free)", r"malloc|free|_int_|cfree"),
    ("kernel (page faults, scheduling, rayon wake-ups)", r"^\[k\]"),
    ("rayon", r"rayon"),
]
totals = {g: 0.0 for g, _ in groups}
other = 0.0
for line in open(sys.argv[1]):
    m = re.match(r"\s*([0-9.]+)%\s+(\[.\])\s+(.*)", line)
    if not m:
        continue
    pct, kind, sym = float(m.group(1)), m.group(2), m.group(3).strip()
    for g, pat in groups:
        if re.search(pat, sym if kind != "[k]" else "[k]"):
            totals[g] += pct
            break
    else:
        other += pct
print("| work | share of samples |")
print("|---|---|")
for g, _ in groups:
    if totals[g] >= 0.5:
        print(f"| {g} | {totals[g]:.1f}% |")
print(f"| everything else | {other:.1f}% |")
PY
