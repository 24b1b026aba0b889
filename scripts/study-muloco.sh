#!/usr/bin/env bash
# The study of docs/RESULTS.md section 9: MuLoCo's recipe (Muon inside the rounds, 2-bit pseudo-gradients
# with error feedback) under constant H and QSR at equal syncs, with and without the outer step that
# served each best in section 7, on the character GPT at its full horizon (1200 steps, K = 4), 3 seeds.
# Needs `cargo build --release --bin qsr` and `bash scripts/fetch-shakespeare.sh`. Writes
# runs/study-muloco-{adamw,muon}-{f32,int2}: 54 runs.
set -euo pipefail
cd "$(dirname "$0")/.."
qsr=${QSR_BIN:-target/release/qsr}
recipe=recipes/shakespeare-char-qsr.toml
diloco="outer.lr=0.7;outer.momentum=0.9;outer.nesterov=true"
# QSR's 93 syncs: constant H = 13 makes as many. QSR is best with the outer momentum per inner step
# (outer.unit = lr), constant H with DiLoCo's per round (section 7).
rules="qsr,qsr+outer:$diloco;outer.unit=lr,constant:h=13,constant+outer:h=13;$diloco"
# Muon with Moonshot's lr adjustment reuses the recipe's AdamW lr and weight decay.
muon=(--set optimizer.kind=muon --set optimizer.adjust_lr_fn=match_rms_adamw)
for inner in adamw muon; do
    sets=()
    [[ $inner == muon ]] && sets=("${muon[@]}")
    # Data parallel once per inner optimizer: its gradient all-reduce is f32 whatever the wire.
    "$qsr" compare --recipe "$recipe" --seeds 3 --out "runs/study-muloco-$inner-f32" "${sets[@]}" \
        --rules "dp,$rules"
    "$qsr" compare --recipe "$recipe" --seeds 3 --out "runs/study-muloco-$inner-int2" "${sets[@]}" \
        --set driver.wire=int2 --rules "$rules"
done
