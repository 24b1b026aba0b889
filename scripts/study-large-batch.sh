#!/usr/bin/env bash
# The study of docs/RESULTS.md section 8: QSR where its claim lives, a large global batch. First the
# generalization gap (data parallel at B = 128 against B = 2,048, 3 seeds), then the rules at B = 2,048.
# `bash scripts/study-large-batch.sh [gap|rules|all]`. Needs `cargo build --release --bin qsr` and
# `apt-get install dataset-fashion-mnist`. Writes runs/study-large-batch/<part>; a part whose
# compare.json exists is skipped, so an interrupted study resumes where its runs directory stops (each
# rule is a part of its own). About 6 minutes per run of 234 steps on 2 cores, 6 for one of 3,720.
set -euo pipefail
cd "$(dirname "$0")/.."
qsr=${QSR_BIN:-target/release/qsr}
part=${1:-all}
recipe=recipes/fashion-mnist-cnn-large-batch.toml
out=runs/study-large-batch

# One compare into $out/$1 unless it finished before; the rest are compare's arguments.
compare() {
    local name=$1
    shift
    if [[ -f $out/$name/compare.json ]]; then
        echo "study-large-batch: $name done before, skipped" >&2
        return
    fi
    # A compare that does not train at all (linear scaling) still writes its table; keep going.
    "$qsr" compare --recipe "$recipe" --seeds 3 --out "$out/$name" "$@" || [[ -f $out/$name/compare.json ]]
}

if [[ $part == gap || $part == all ]]; then
    # Small batch: section 7's setting (K = 4 x 32 = 128, lr 0.1, 2 warmup epochs, 3,720 steps).
    compare gap-b128 --rules dp --set train.workers=4 --set train.local_batch=32 --set schedule.lr_max=0.1 \
        --set schedule.total_steps=3720 --set schedule.warmup_steps=186
    # Large batch: the recipe (K = 16 x 128 = 2,048, lr 0.4 by square-root scaling, 5 warmup epochs).
    compare gap-b2048 --rules dp
    # The same with linear scaling (lr 1.6): what the large-batch literature does first.
    compare gap-b2048-linear --rules dp --set schedule.lr_max=1.6
fi
if [[ $part == rules || $part == all ]]; then
    # At B = 2,048 (data parallel is gap-b2048's): QSR at two budgets (sync.budget 0.3: alpha 0.43, 70
    # syncs; 0.2: alpha 0.69, 46), the constant Hs at about their syncs (H = 3: 78, H = 5: 47), and
    # post-local SGD (data parallel for the first quarter, then H = 4).
    compare rules-qsr-0.3 --rules "qsr:h_base=2;budget=0.3"
    compare rules-constant-h3 --rules "constant:h=3"
    compare rules-qsr-0.2 --rules "qsr:h_base=2;budget=0.2"
    compare rules-constant-h5 --rules "constant:h=5"
    compare rules-post-local --rules "post-local:h=4;switch_step=58"
fi
