#!/usr/bin/env bash
# The study of docs/RESULTS.md section 7: QSR in its own regime (many epochs, a long small-lr tail) and an
# outer optimizer at QSR's changing H, 3 seeds each. `bash scripts/study-regime.sh [images|text|all]`.
# Needs `cargo build --release --bin qsr`; images: `apt-get install dataset-fashion-mnist`; text:
# `bash scripts/fetch-shakespeare.sh`. Writes runs/study-regime-images and runs/study-regime-text.
set -euo pipefail
cd "$(dirname "$0")/.."
qsr=${QSR_BIN:-target/release/qsr}
part=${1:-all}
if [[ $part == images || $part == all ]]; then
    # 40 epochs of 12,000 Fashion-MNIST images, cosine to 1e-6: data parallel, constant H = h_base and
    # the constant Hs that bracket each QSR's syncs (alpha 0.05: 1325 syncs, H = 3 makes 1240; alpha 0.1:
    # 1059, H = 4 makes 930), post-local SGD (data parallel for the first quarter, then H = 4), QSR.
    # 21 runs, about an hour on 2 cores.
    "$qsr" compare --recipe recipes/fashion-mnist-cnn-qsr.toml --seeds 3 --out runs/study-regime-images \
        --rules "dp,constant:h=2,constant:h=3,constant:h=4,post-local:h=4;switch_step=930,qsr:alpha=0.05,qsr:alpha=0.1"
fi
if [[ $part == text || $part == all ]]; then
    # The character GPT at the recipe's full horizon (1200 steps): plain QSR, QSR with DiLoCo's outer step
    # (momentum 0.9 per round), QSR with the momentum per inner step (outer.unit = lr), constant H
    # matched to QSR's syncs with DiLoCo's outer step, data parallel. 15 runs, about 45 minutes.
    diloco="outer.lr=0.7;outer.momentum=0.9;outer.nesterov=true"
    "$qsr" compare --recipe recipes/shakespeare-char-qsr.toml --seeds 3 --out runs/study-regime-text \
        --rules "dp,qsr,qsr+outer:$diloco,qsr+outer:$diloco;outer.unit=lr,constant+outer:h=13;$diloco"
fi
