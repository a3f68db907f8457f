#!/usr/bin/env bash
# configs/cifar100.yaml end to end through the CLI: fit, one single-client and one multi-client
# unlearn, audit. The data are a CIFAR-100 archive in its native format (cifar-100-python.tar.gz,
# Python 2 pickles, 50,000 + 10,000 random uint8 images, 100 fine classes), written here by
# benchmarks/fake_cifar100.py, since a device machine reaches no network.
#   bash benchmarks/cifar100_end_to_end.sh [FIT_LIMIT_S] [EXTRA CLI ARGS...]
# Each command runs under its own time limit (fit FIT_LIMIT_S, default 480 s; unlearn 60 s each;
# audit 120 s) and prints its wall time; an unfinished fit still prints every stage it trained.
# A smoke run on a CPU: bash benchmarks/cifar100_end_to_end.sh 600 --data.num_clients 8 \
#   --trainer.accelerator cpu   (with CIFAR_SAMPLES=40 for a tiny archive)
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 WANDB_MODE=offline
FIT_LIMIT="${1:-480}"
shift || true
WORK="$(mktemp -d /tmp/cifar100-e2e-XXXXXX)"
FAILED=()
timed() {  # timed NAME LIMIT CMD...: one command under its limit, its wall time printed
  local name="$1" limit="$2"
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@"
  local rc=$?
  echo "-- $name: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || FAILED+=("$name (exit $rc)")
  return "$rc"
}
"$PY" benchmarks/fake_cifar100.py "$WORK/data/cifar100" --per-batch "${CIFAR_SAMPLES:-10000}" || exit 1
ARGS=(--config configs/cifar100.yaml --data.data_dir "$WORK/data" --data.download false
  --trainer.default_root_dir "$WORK/runs" --trainer.run_name e2e "$@")
if timed fit "$FIT_LIMIT" "$PY" -m fedshard_lightning fit "${ARGS[@]}"; then
  RUN="$WORK/runs/e2e"
  timed "unlearn one client" 60 "$PY" -m fedshard_lightning unlearn --ckpt_path "$RUN" --clients '[3]'
  timed "unlearn three clients" 60 "$PY" -m fedshard_lightning unlearn --ckpt_path "$RUN" \
    --clients '[0, 5, 7]'
  timed audit 120 "$PY" -m fedshard_lightning audit --ckpt_path "$RUN"
fi
if [ "${#FAILED[@]}" -eq 0 ]; then
  echo "cifar100 end to end: every command passed"
else
  printf 'cifar100 end to end FAILED: %s\n' "${FAILED[@]}"
  exit 1
fi
