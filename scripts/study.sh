#!/usr/bin/env bash
# The study of docs/RESULTS.md: the power gamma x H_base ablation and dp / constant H / QSR / QSR + outer
# optimizer, 3 seeds each, on the Shakespeare character model and on digits. Needs
# scripts/fetch-shakespeare.sh first and `cargo build --release --bin qsr`. Writes runs/study-*/.
set -euo pipefail
cd "$(dirname "$0")/.."
qsr=${QSR_BIN:-target/release/qsr}
rules="dp,constant:h=4"
for gamma in 1 2 3; do
    for h_base in 2 4; do
        rules+=",power:power=$gamma;h_base=$h_base"
    done
done
rules+=",qsr+outer"
# 600 steps (half the recipe's horizon) keep the 27 runs near half an hour on 2 cores.
"$qsr" compare --recipe recipes/shakespeare-char-qsr.toml --seeds 3 --rules "$rules" --out runs/study-shakespeare \
    --set schedule.total_steps=600 --set schedule.warmup_steps=30
"$qsr" compare --recipe recipes/digits-qsr.toml --seeds 3 --rules "$rules" --out runs/study-digits
# QSR with its parameter syncs in bf16 (driver.wire), against the f32 row above.
"$qsr" compare --recipe recipes/shakespeare-char-qsr.toml --seeds 3 --rules qsr --out runs/study-shakespeare-bf16 \
    --set schedule.total_steps=600 --set schedule.warmup_steps=30 --set driver.wire=bf16
