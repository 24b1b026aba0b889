#!/usr/bin/env bash
# The study of docs/RESULTS.md section 9: MuLoCo's recipe (Muon inside the rounds, 2-bit pseudo-gradients
# with error feedback) under constant H and QSR at equal syncs, with and without an outer step, on the
# character GPT at its full horizon (1200 steps, K = 4), 3 seeds. Needs `cargo build --release --bin qsr`
# and `bash scripts/fetch-shakespeare.sh`. Writes runs/study-muloco-{adamw,muon}-{f32,int2}, 54 runs; a
# comparison already written is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
qsr=${QSR_BIN:-target/release/qsr}
recipe=recipes/shakespeare-char-qsr.toml
diloco="outer.lr=0.7;outer.momentum=0.9;outer.nesterov=true"
# QSR's 93 syncs: constant H = 13 makes as many. Section 7's best outer step for each: QSR with the
# momentum per inner step (outer.unit = lr), constant H with DiLoCo's per round. A quantized wire takes
# the outer step per sync only, so under int2 QSR's is DiLoCo's too.
rules="qsr,qsr+outer:$diloco;outer.unit=lr,constant:h=13,constant+outer:h=13;$diloco"
rules_int2="qsr,qsr+outer:$diloco,constant:h=13,constant+outer:h=13;$diloco"
# Muon with Moonshot's lr adjustment reuses the recipe's AdamW lr and weight decay.
muon=(--set optimizer.kind=muon --set optimizer.adjust_lr_fn=match_rms_adamw)
compare() {
    local out=$1
    shift
    [[ -f $out/compare.md ]] && return 0
    "$qsr" compare --recipe "$recipe" --seeds 3 --out "$out" "$@"
}
for inner in adamw muon; do
    sets=()
    [[ $inner == muon ]] && sets=("${muon[@]}")
    # Data parallel once per inner optimizer: its gradient all-reduce is f32 whatever the wire.
    compare "runs/study-muloco-$inner-f32" "${sets[@]}" --rules "dp,$rules"
    compare "runs/study-muloco-$inner-int2" "${sets[@]}" --set driver.wire=int2 --rules "$rules_int2"
done
