#!/usr/bin/env bash
# Kernel launches per step on burn's wgpu backend (Mesa lavapipe here), with and without burn's fusion
# and autotune: docs/BENCHMARKS.md, "Kernel launches per step on wgpu".
#
# Build both binaries first (each compiles burn for wgpu, ~13 min on 2 cores):
#   cargo build --release -p qsr-train --features wgpu-plain --bin qsr && cp target/release/qsr /tmp/qsr-wgpu-plain
#   cargo build --release -p qsr-train --features wgpu --bin qsr && cp target/release/qsr /tmp/qsr-wgpu
# then: bash scripts/wgpu-launches.sh /tmp/qsr-wgpu-plain /tmp/qsr-wgpu > table.md
set -euo pipefail
PLAIN=$1 FUSED=$2
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
cases=("cnn|--model cnn --batch 64" "gpt-medium|--model gpt --layers 4 --heads 8 --width 256 --context 128 --batch 4"
       "resnet20|--model resnet20 --batch 16")
for c in "${cases[@]}"; do
    name=${c%%|*}; read -r -a args <<< "${c#*|}"
    for build in plain fused; do
        bin=$PLAIN; [ "$build" = fused ] && bin=$FUSED
        "$bin" time-step "${args[@]}" --device wgpu --steps "${STEPS:-5}" --warmup "${WARMUP:-2}" \
            --json "$OUT/$name-$build.json" >&2
    done
done
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
print("| step (wgpu, lavapipe) | launches, plain | launches, fusion + autotune | ratio | step ms, plain | step ms, fusion + autotune |")
print("|---|---|---|---|---|---|")
for name in ("cnn", "gpt-medium", "resnet20"):
    p, f = (json.load(open(os.path.join(out, f"{name}-{b}.json"))) for b in ("plain", "fused"))
    assert not p["fusion"] and f["fusion"], "the first binary must be the plain build, the second the fused one"
    lp, lf = p["launches_per_step"], f["launches_per_step"]
    print(f"| {name} batch {p['batch']} | {lp:.0f} | {lf:.0f} | {lf / lp:.2f} | {p['step_ms_median']:.1f} | {f['step_ms_median']:.1f} |")
PY
