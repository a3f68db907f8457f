#!/usr/bin/env bash
# The GPU check of the engine, in one call (5-8 minutes on an H100, docs/gpu.md):
#   bash benchmarks/device_check.sh [LOG]       (default LOG: $OUT/device_check.log, else ./device_check.log)
# It ends with "every step passed", or names each failed step and exits 1.
# Prints the device, runs the `cuda` tests, engine vs loop on CUDA (digits MLP, 2NN, FedAvg CNN,
# ResNetGN at K=64 and 256, B=10; with and without batch invariance; the CNN and ResNetGN with
# IEEE float32; torch.compile'd with DEVICE_CHECK_COMPILE=1), the stacked convolution routes,
# utilisation against the GPU's own fp32 matmul peak, and one
# FedShard stage of configs/cifar100.yaml on synthetic CIFAR-100-shaped data with the projected
# time of the whole run. Each step has its own time limit, so one slow step cannot eat the rest:
# together at most 580 s (640 s with DEVICE_CHECK_COMPILE=1), inside a 10-minute call; the H100
# run in docs/gpu.md took 7m42s.
# Needs: torch with CUDA, lightning, torchmetrics, scikit-learn, safetensors, pytest (the package
# itself is imported from this checkout; the CLI's jsonargparse and wandb are not needed).
set -uo pipefail
cd "$(dirname "$0")/.."
LOG="${1:-${OUT:-.}/device_check.log}"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
BUDGET="${DEVICE_CHECK_BUDGET_MB:-16384}"
step() { CURRENT="$1"; echo; echo "== $1 ($(date -u +%H:%M:%S))"; }
FAILED=()
# run LIMIT CMD...: one step's command under its own time limit; a failure is named at the end.
run() { timeout "$@"; local rc=$?; [ "$rc" -eq 0 ] || FAILED+=("${CURRENT} (exit ${rc})"); }
{
  step "device"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  step "cuda tests"
  run 100 "$PY" -m pytest -q -m cuda -p no:cacheprovider tests/engine/test_cuda.py
  step "engine vs loop, chunk budget ${BUDGET} MB"
  run 170 "$PY" benchmarks/engine_vs_loop.py --suite gpu --device cuda --rounds 3 --repeats 3 \
    --memory-budget-mb "$BUDGET" --variant-too
  step "IEEE float32 (trainer.tf32 false) at K=256"
  run 100 "$PY" benchmarks/engine_vs_loop.py --suite gpu --device cuda --rounds 3 --repeats 3 \
    --memory-budget-mb "$BUDGET" --workloads cifar-cnn cifar-resnetgn --clients 256 --tf32 off
  if [ -n "${DEVICE_CHECK_COMPILE:-}" ]; then  # 0.84-1.01x of eager in three runs (docs/gpu.md)
    step "torch.compile'd CIFAR CNN step (K=256)"
    run 60 "$PY" benchmarks/engine_vs_loop.py --suite gpu --device cuda --rounds 3 --repeats 3 \
      --memory-budget-mb "$BUDGET" --workloads cifar-cnn --clients 256 --compile
  fi
  step "stacked convolutions by route, IEEE and TF32"
  run 35 "$PY" benchmarks/conv_modes.py --device cuda --tf32 both --repeats 5
  step "utilisation"
  run 35 "$PY" benchmarks/utilisation.py --device cuda
  step "FedShard stage 1 of configs/cifar100.yaml (synthetic CIFAR-100 shape)"
  run 140 "$PY" benchmarks/cifar100_stage.py --accelerator cuda
  step "done"
  if [ "${#FAILED[@]}" -eq 0 ]; then
    echo "every step passed"
  else
    printf 'FAILED: %s\n' "${FAILED[@]}"
    exit 1
  fi
} 2>&1 | tee "$LOG"
