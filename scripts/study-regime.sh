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
    # 21 runs, 40 minutes on 2 cores; then 18 more without augmentation.
    "$qsr" compare --recipe recipes/fashion-mnist-cnn-qsr.toml --seeds 3 --out runs/study-regime-images \
        --rules "dp,constant:h=2,constant:h=3,constant:h=4,post-local:h=4;switch_step=930,qsr:alpha=0.05,qsr:alpha=0.1"
    # The same without augmentation: the CNN then fits its 12,000 images (the paper's generalization gap).
    "$qsr" compare --recipe recipes/fashion-mnist-cnn-qsr.toml --seeds 3 --out runs/study-regime-images-noaug \
        --set data.augment=false --rules "dp,constant:h=2,constant:h=3,constant:h=4,qsr:alpha=0.05,qsr:alpha=0.1"
fi
if [[ $part == text || $part == all ]]; then
    # The character GPT at the recipe's full horizon (1200 steps): data parallel; plain QSR, with DiLoCo's
    # outer step (momentum 0.9 per round) and with the momentum per inner step (outer.unit = lr); constant
    # H = 13, QSR's 93 syncs, plain and with both outer steps. 21 + 6 runs, about 9 minutes.
    diloco="outer.lr=0.7;outer.momentum=0.9;outer.nesterov=true"
    "$qsr" compare --recipe recipes/shakespeare-char-qsr.toml --seeds 3 --out runs/study-regime-text \
        --rules "dp,qsr,qsr+outer:$diloco,qsr+outer:$diloco;outer.unit=lr,constant:h=13,constant+outer:h=13;$diloco,constant+outer:h=13;$diloco;outer.unit=lr"
    # The momentum per inner step that DiLoCo's 0.9 per round of 13 steps is: 0.9^(1/13) = 0.992.
    per_step="outer.lr=0.7;outer.momentum=0.992;outer.nesterov=true;outer.unit=lr"
    "$qsr" compare --recipe recipes/shakespeare-char-qsr.toml --seeds 3 --out runs/study-regime-text-0.992 \
        --rules "qsr+outer:$per_step,constant+outer:h=13;$per_step"
fi
