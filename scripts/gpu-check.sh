#!/usr/bin/env bash
# GPU check for qsr (issues 7, 44), run from the repository root on a machine with one NVIDIA GPU.
#
# It builds nothing. Prepare on the build machine:   cargo xtask cuda --package
# (writes dist/gpu/qsr.xz, the CUDA + NCCL build of `qsr` with burn's fusion and autotune,
# dist/gpu/qsr-plain.xz, the same without them, and dist/gpu/fashion-mnist/), then carry dist/gpu
# to the GPU machine and run:                       bash scripts/gpu-check.sh
#
# Inside ~11 minutes it:
#   1. `qsr device-check`: the cubecl kernels bit-exact against the host path (K = 1..8, random data,
#      NaN-filled outputs), then the fused average-and-broadcast of K = 4 x 256 MiB against a device
#      copy of the same bytes (goal: >= 0.85 of the copy's bandwidth, one launch per sync);
#   2. CIFAR ResNet-20 on Fashion-MNIST, K = 4 simulated workers on the GPU, data parallel vs QSR
#      (steps/s of the four workers on one card);
#   3. one training step of the medium GPT (4 layers, 8 heads, width 256, context 128, batch 16), of a
#      GPT-2-small shape (12 layers, 12 heads, width 768, context 512, batch 8) and of ResNet-20
#      (batch 128): `qsr time-step` of both builds (plain, then fusion + autotune) with kernel launches
#      per step, against PyTorch eager on the same card (benches/peers/train_step.py with the image's
#      python3); then a kernel profile of the fused build's ResNet-20 and GPT-2-small steps;
# and prints short tables (also written to $RESULTS/gpu-check.md). Where one command may run at most
# 10 minutes, run it as two: SECTIONS="kernels train" (about 5 min), then SECTIONS="steps profile"
# (about 6 min, both builds' autotune warm-ups included).
#
# SECTIONS (default "kernels train steps profile") picks parts, STEP_STEPS / STEP_WARMUP size part 3,
# GPT2 overrides the GPT-2-small case's arguments; PYTHON (default python3) runs the PyTorch peer, and a
# python without torch leaves the peer's column empty. Without qsr-plain.xz the plain column is empty.
#
# Run-time libraries: NVRTC (compiles the kernels), the CUDA headers, and libnccl are taken from the
# system CUDA toolkit when present, else from the nvidia-* Python wheels of the machine's image.
set -uo pipefail

DIST=${DIST:-dist/gpu}
DEVICE=${DEVICE:-cuda:0}          # DEVICE=cpu STEPS=20 smoke-tests the script on a CPU build
STEPS=${STEPS:-}
RESULTS=${RESULTS:-${OUT:-/tmp/qsr-gpu-check}}
WORK=${WORK:-/tmp/qsr-gpu-work}
mkdir -p "$RESULTS" "$WORK"
QSR="$WORK/qsr"
QSR_PLAIN="$WORK/qsr-plain"
T0=$(date +%s)
say() { echo "[gpu-check $(( $(date +%s) - T0 ))s] $*"; }

# unpack NAME: $WORK/NAME from $DIST/NAME.xz or $DIST/NAME, unless already there.
unpack() {
    [ -x "$WORK/$1" ] && return 0
    if [ -f "$DIST/$1.xz" ]; then xz -dc "$DIST/$1.xz" > "$WORK/$1"; elif [ -f "$DIST/$1" ]; then cp "$DIST/$1" "$WORK/$1"; else return 1; fi
    chmod +x "$WORK/$1"
}
if ! unpack qsr; then
    echo "no $DIST/qsr.xz: run \`cargo xtask cuda --package\` on the build machine and carry $DIST" >&2; exit 2
fi
unpack qsr-plain || say "no $DIST/qsr-plain.xz: the plain build's column stays empty"

# --- run-time libraries ---------------------------------------------------------------------------
libdirs=()
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do [ -d "$d" ] && libdirs+=("$d"); done
if ! ldconfig -p 2>/dev/null | grep -q 'libnvrtc\.so' && ! ls /usr/local/cuda/lib64/libnvrtc.so* >/dev/null 2>&1; then
    site=$(python3 -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))' 2>/dev/null || true)
    if [ -n "$site" ]; then
        while IFS= read -r d; do libdirs+=("$d"); done < <(find "$site/nvidia" -maxdepth 3 -type d -name lib 2>/dev/null)
    fi
fi
if ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so'; then
    site=${site:-$(python3 -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))' 2>/dev/null || true)}
    [ -n "$site" ] && while IFS= read -r d; do libdirs+=("$d"); done < <(find "$site/nvidia" -maxdepth 3 -type d -path '*nccl*' -name lib 2>/dev/null)
fi
if [ ${#libdirs[@]} -gt 0 ]; then
    LD_LIBRARY_PATH="$(IFS=:; echo "${libdirs[*]}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export LD_LIBRARY_PATH
fi
if [ -z "${CUDA_PATH:-}" ]; then
    for d in /usr/local/cuda /usr/local/cuda-13.0; do [ -f "$d/include/cuda.h" ] && CUDA_PATH=$d && break; done
    if [ -z "${CUDA_PATH:-}" ] && [ -n "${site:-}" ]; then
        h=$(find "$site/nvidia" -maxdepth 4 -name cuda_runtime.h 2>/dev/null | head -1)
        [ -n "$h" ] && CUDA_PATH=$(dirname "$(dirname "$h")")
    fi
    export CUDA_PATH
fi
say "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo 'nvidia-smi not found')"
say "CUDA_PATH=${CUDA_PATH:-unset} LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-unset}"

SECTIONS=${SECTIONS:-kernels train steps profile}
PYTHON=${PYTHON:-python3}
STEP_STEPS=${STEP_STEPS:-20}
STEP_WARMUP=${STEP_WARMUP:-5}
has() { case " $SECTIONS " in *" $1 "*) return 0 ;; esac; return 1; }

status=0
# --- 1. kernels ----------------------------------------------------------------------------------
if [ "$DEVICE" != cpu ] && has kernels; then
    say "device-check"
    timeout 120 "$QSR" device-check --device "$DEVICE" --k 4 --mib 256 --repeats 20 2>&1 | tee "$RESULTS/device-check.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

# --- 2. training: data parallel vs QSR -----------------------------------------------------------
DATA=${DATA:-$DIST/fashion-mnist}
[ -f "$DATA/train-images-idx3-ubyte.gz" ] || DATA=/usr/share/datasets/fashion-mnist
has train && for rule in dp qsr; do
    say "train $rule"
    rm -rf "$WORK/runs/$rule"
    extra=()
    [ -n "$STEPS" ] && extra=(--set "train.steps=$STEPS")
    timeout 170 "$QSR" train --recipe recipes/fashion-mnist-resnet20-gpu.toml --device "$DEVICE" --quiet \
        --set "sync.rule=$rule" --set "data.path=$DATA" "${extra[@]}" --out "$WORK/runs/$rule" 2>&1 | tail -5 | tee "$RESULTS/train-$rule.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done

# --- 3. one training step: qsr (burn, plain and fused builds) against PyTorch eager on the same device
STEPS_DIR="$WORK/steps"
rm -rf "$STEPS_DIR"; mkdir -p "$STEPS_DIR"
read -r -a gpt2 <<< "${GPT2:---layers 12 --heads 12 --width 768 --context 512 --batch 8}"
case_args() {
    case "$1" in
        gpt-medium) echo --model gpt --layers 4 --heads 8 --width 256 --context 128 --batch 16 ;;
        gpt2-small) echo --model gpt "${gpt2[@]}" ;;
        resnet20) echo --model resnet20 ;;
    esac
}
CASES="gpt-medium gpt2-small resnet20"
if has steps; then
    for case in $CASES; do
        read -r -a args <<< "$(case_args "$case")"
        for build in qsr-plain qsr; do
            [ -x "$WORK/$build" ] || continue
            say "time-step $case ($build)"
            timeout 100 "$WORK/$build" time-step "${args[@]}" --device "$DEVICE" --steps "$STEP_STEPS" --warmup "$STEP_WARMUP" \
                --json "$STEPS_DIR/$case-$build.json" || status=1
        done
        # cpu, cuda and cuda:N mean the same device to PyTorch.
        timeout 100 "$PYTHON" benches/peers/train_step.py "${args[@]}" --device "$DEVICE" --steps "$STEP_STEPS" --warmup "$STEP_WARMUP" \
            --json "$STEPS_DIR/$case-torch.json" 2>&1 | tail -2 || true
    done
fi
# --- 4. where the fused build's device time goes, kernel by kernel ------------------------------------
if [ "$DEVICE" != cpu ] && has profile; then
    for case in resnet20 gpt2-small; do
        read -r -a args <<< "$(case_args "$case")"
        say "profile $case"
        timeout 100 "$QSR" time-step "${args[@]}" --device "$DEVICE" --steps 2 --warmup "$STEP_WARMUP" --profile 2 \
            2>&1 | tee "$RESULTS/profile-$case.txt" | head -30
    done
fi

# --- table ---------------------------------------------------------------------------------------
python3 - "$WORK/runs" "$RESULTS/device-check.txt" "$SECTIONS" <<'PY' | tee "$RESULTS/gpu-check.md"
import json, os, sys
runs, dc, sections = sys.argv[1], sys.argv[2], sys.argv[3].split()
if "train" in sections:
    print("| run | steps | steps/s | syncs | comm % of DP | test accuracy |")
    print("|---|---|---|---|---|---|")
for rule in ("dp", "qsr") if "train" in sections else ():
    p = os.path.join(runs, rule, "summary.json")
    if not os.path.exists(p):
        print(f"| {rule} | failed (see train-{rule}.txt) | | | | |"); continue
    s = json.load(open(p))
    print(f"| {rule} | {s['steps']} | {s['steps_per_second']:.2f} | {s['syncs']} | {s['comm_percent']:.1f} | {100*s['final_test_accuracy']:.2f}% |")
steps = os.path.join(os.path.dirname(runs), "steps")
def load(case, build):
    p = os.path.join(steps, f"{case}-{build}.json")
    return json.load(open(p)) if os.path.exists(p) else None
cases = [c for c in ("gpt-medium", "gpt2-small", "resnet20") if load(c, "qsr") or load(c, "qsr-plain")]
if cases:
    print()
    print("| one training step | PyTorch eager | burn plain | ratio | burn fusion + autotune | ratio | launches per step, plain -> fused |")
    print("|---|---|---|---|---|---|---|")
for c in cases:
    t, plain, fused = load(c, "torch"), load(c, "qsr-plain"), load(c, "qsr")
    unit = (fused or plain)["unit"] + "/s"
    def rate(x):
        return f"{x['per_second']:.0f} {unit}" if x else "-"
    def ratio(x):
        return f"{x['per_second'] / t['per_second']:.2f}" if x and t else "-"
    def launches(x):
        n = x.get("launches_per_step") if x else None
        return f"{n:.0f}" if n is not None else "-"
    print(f"| {c} | {rate(t)} | {rate(plain)} | {ratio(plain)} | {rate(fused)} | {ratio(fused)} | {launches(plain)} -> {launches(fused)} |")
if os.path.exists(dc):
    print()
    for line in open(dc):
        if line.startswith(("|", "correctness", "fused /", "device-check", "  MISMATCH")):
            print(line.rstrip())
PY
say "done (exit $status)"
exit $status
