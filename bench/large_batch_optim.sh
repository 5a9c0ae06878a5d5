#!/usr/bin/env bash
# Large-batch study: the MLP on Fashion-MNIST at one large global batch, trained for the same
# number of epochs with sgd (momentum, linear-scaled lr), lars and lamb; test accuracy and
# final training loss of each. Every run uses the same seed, warmup and cosine schedule, on 2
# workers (ZeRO-1). Not a test: the figures depend on the learning rates below, which are
# guesses scaled from the small-batch defaults, not tuned.
# The first row is the small-batch reference: sgd at tandem train's defaults (batch 128, lr 0.05).
# Usage: bench/large_batch_optim.sh [tandem binary] [global batch] [epochs]
set -euo pipefail
tandem=${1:-build/tandem}
batch=${2:-4096}
epochs=${3:-3}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
steps_per_epoch=$((60000 / batch))
common=(-n 2 --model mlp --strategy zero1 --epochs "$epochs" --seed 3 --threads 1 --no-baseline --no-progress
        --schedule cosine --weight-decay 1e-4)
printf "%-6s %6s %-48s %10s %12s %10s\n" optimizer batch "options" "accuracy" "final loss" "seconds"
run() {  # run NAME BATCH WARMUP_STEPS OPTIONS...
  local name=$1 b=$2 warmup=$3; shift 3
  local t0=$SECONDS
  rm -f "$out/run.jsonl"
  if ! "$tandem" train "${common[@]}" --batch "$b" --warmup-steps "$warmup" --optimizer "$name" "$@" --metrics "$out/run.jsonl" >"$out/log" 2>&1; then
    grep -q "loss became" "$out/log" || { cat "$out/log"; exit 1; }
    printf "%-6s %6s %-48s %10s %12s %10s\n" "$name" "$b" "$*" diverged "-" "$((SECONDS - t0))"
    return
  fi
  python3 - "$out/run.jsonl" "$name" "$b" "$*" "$((SECONDS - t0))" <<'PY'
import json, sys
rep = [d for d in map(json.loads, open(sys.argv[1])) if d.get("report")][-1]
name, b, opts, secs = sys.argv[2:]
print(f"{name:<6} {b:>6} {opts:<48} {rep['test_accuracy']:>10.4f} {rep['final_loss']:>12.4f} {secs:>10}")
PY
}
run sgd 128 0 --lr 0.05 --momentum 0.9
# sgd: 0.05 at batch 128 (tandem train's default) scaled linearly (Goyal et al.) and by the
# square root of the batch ratio; lars and lamb at two learning rates each.
run sgd "$batch" "$steps_per_epoch" --lr "$(python3 -c "print(0.05 * $batch / 128)")" --momentum 0.9
run sgd "$batch" "$steps_per_epoch" --lr "$(python3 -c "print(round(0.05 * ($batch / 128) ** 0.5, 4))")" --momentum 0.9
for lr in 2 8; do run lars "$batch" "$steps_per_epoch" --lr "$lr" --momentum 0.9 --trust-coefficient 0.001; done
for lr in 0.005 0.02; do run lamb "$batch" "$steps_per_epoch" --lr "$lr"; done
