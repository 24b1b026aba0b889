#!/usr/bin/env bash
# GPU check for qsr (issue 7), run from the repository root on a machine with one NVIDIA GPU.
#
# It builds nothing. Prepare on the build machine:   cargo xtask cuda --package
# (writes dist/gpu/qsr.xz, the CUDA + NCCL build of `qsr`, and dist/gpu/fashion-mnist/), then carry
# dist/gpu to the GPU machine and run:               bash scripts/gpu-check.sh
#
# Inside ~8 minutes it:
#   1. `qsr device-check`: the cubecl kernels bit-exact against the host path (K = 1..8, random data,
#      NaN-filled outputs), then the fused average-and-broadcast of K = 4 x 256 MiB against a device
#      copy of the same bytes (goal: >= 0.85 of the copy's bandwidth, one launch per sync);
#   2. CIFAR ResNet-20 on Fashion-MNIST, K = 4 simulated workers on the GPU, data parallel vs QSR;
#   3. one training step of the medium GPT (4 layers, 8 heads, width 256, context 128, batch 16) and of
#      ResNet-20 (batch 128): `qsr time-step` on burn's CUDA backend against PyTorch eager on the same
#      card (benches/peers/train_step.py with the image's python3);
# and prints short tables (also written to $RESULTS/gpu-check.md).
#
# SECTIONS (default "kernels train steps") picks parts, STEP_STEPS / STEP_WARMUP size part 3; PYTHON (default python3) runs the PyTorch peer,
# and a python without torch leaves the peer's column empty.
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
T0=$(date +%s)
say() { echo "[gpu-check $(( $(date +%s) - T0 ))s] $*"; }

if [ ! -x "$QSR" ]; then
    if [ -f "$DIST/qsr.xz" ]; then xz -dc "$DIST/qsr.xz" > "$QSR"; elif [ -f "$DIST/qsr" ]; then cp "$DIST/qsr" "$QSR"; else
        echo "no $DIST/qsr.xz: run \`cargo xtask cuda --package\` on the build machine and carry $DIST" >&2; exit 2
    fi
    chmod +x "$QSR"
fi

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

SECTIONS=${SECTIONS:-kernels train steps}
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

# --- 3. one training step: qsr (burn) against PyTorch eager on the same device ----------------------
STEPS_DIR="$WORK/steps"
rm -rf "$STEPS_DIR"; mkdir -p "$STEPS_DIR"
medium=(--layers 4 --heads 8 --width 256 --context 128 --batch 16)
if has steps; then
    for case in gpt-medium resnet20; do
        if [ "$case" = gpt-medium ]; then args=(--model gpt "${medium[@]}"); else args=(--model resnet20); fi
        say "time-step $case"
        timeout 120 "$QSR" time-step "${args[@]}" --device "$DEVICE" --steps "$STEP_STEPS" --warmup "$STEP_WARMUP" \
            --json "$STEPS_DIR/$case-qsr.json" || status=1
        # cpu, cuda and cuda:N mean the same device to PyTorch.
        timeout 120 "$PYTHON" benches/peers/train_step.py "${args[@]}" --device "$DEVICE" --steps "$STEP_STEPS" --warmup "$STEP_WARMUP" \
            --json "$STEPS_DIR/$case-torch.json" 2>&1 | tail -2 || true
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
cases = [c for c in ("gpt-medium", "resnet20") if os.path.exists(os.path.join(steps, f"{c}-qsr.json"))]
if cases:
    print()
    print("| one training step | qsr (burn) | PyTorch eager | ratio |")
    print("|---|---|---|---|")
for c in cases:
    q = json.load(open(os.path.join(steps, f"{c}-qsr.json")))
    t_path = os.path.join(steps, f"{c}-torch.json")
    t = json.load(open(t_path)) if os.path.exists(t_path) else None
    unit = q["unit"] + "/s"
    torch = f"{t['per_second']:.0f} {unit}" if t else "- (no torch)"
    ratio = f"{q['per_second'] / t['per_second']:.2f}" if t else "-"
    print(f"| {c} | {q['per_second']:.0f} {unit} | {torch} | {ratio} |")
if os.path.exists(dc):
    print()
    for line in open(dc):
        if line.startswith(("|", "correctness", "fused /", "device-check", "  MISMATCH")):
            print(line.rstrip())
PY
say "done (exit $status)"
exit $status
