#!/usr/bin/env bash
# Large-batch study: the CNN on Fashion-MNIST for one fixed budget of epochs at global batch 128
# (SGD, tandem train's defaults) and at larger batches with SGD (linear scaling rule, warmup), LARS
# and LAMB, each at a small learning-rate sweep. Test accuracy and final training loss of every
# run, as a markdown table on stdout and as TSV rows in RESULTS (for bench/large_batch_plot.sh).
# Runs already in RESULTS are not repeated, so an interrupted study continues where it stopped.
# Every run: 2 workers (ZeRO-1), seed 3, cosine schedule, weight decay 1e-4; the large batches
# warm up linearly from 0 over the first 2 epochs. Not a test: a study of the optimizers.
# Usage: bench/large_batch_optim.sh [tandem binary] [epochs] [results.tsv] [model] [batches...]
#   default: build/tandem 20 large_batch.tsv cnn 1024 4096
set -euo pipefail
tandem=${1:-build/tandem}
epochs=${2:-20}
results=${3:-large_batch.tsv}
model=${4:-cnn}
shift $(($# < 4 ? $# : 4))
batches=("$@")
((${#batches[@]})) || batches=(1024 4096)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
common=(-n 2 --model "$model" --strategy zero1 --epochs "$epochs" --seed 3 --threads 1 --no-baseline --no-progress
        --schedule cosine --weight-decay 1e-4)
[[ -s $results ]] || printf "optimizer\tbatch\tlr\taccuracy\tfinal_loss\tseconds\n" >"$results"
echo "| optimizer | global batch | lr | test accuracy | final loss | seconds |"
echo "|---|---|---|---|---|---|"
run() {  # run OPTIMIZER BATCH LR OPTIONS...
  local name=$1 b=$2 lr=$3; shift 3
  local warmup=0 t0=$SECONDS acc=diverged loss=- done
  if done=$(grep -P "^$name\t$b\t$lr\t" "$results"); then
    IFS=$'\t' read -r _ _ _ acc loss t0 <<<"$done"
    echo "| $name | $b | $lr | $acc | $loss | $t0 |"
    return
  fi
  ((b > 128)) && warmup=$((2 * 60000 / b))
  rm -f "$out/run.jsonl"
  if "$tandem" train "${common[@]}" --batch "$b" --warmup-steps "$warmup" --optimizer "$name" --lr "$lr" "$@" \
      --metrics "$out/run.jsonl" >"$out/log" 2>&1; then
    read -r acc loss < <(python3 -c '
import json, sys
rep = [d for d in map(json.loads, open(sys.argv[1])) if d.get("report")][-1]
print("%.2f %.4f" % (100 * rep["test_accuracy"], rep["final_loss"]))' "$out/run.jsonl")
  else
    grep -q "loss became" "$out/log" || { cat "$out/log"; exit 1; }
  fi
  printf "%s\t%s\t%s\t%s\t%s\t%s\n" "$name" "$b" "$lr" "$acc" "$loss" "$((SECONDS - t0))" >>"$results"
  echo "| $name | $b | $lr | $acc | $loss | $((SECONDS - t0)) |"
}
run sgd 128 0.05 --momentum 0.9
for b in "${batches[@]}"; do
  # SGD: 0.05 at batch 128 scaled linearly (Goyal et al.).
  run sgd "$b" "$(python3 -c "print(0.05 * $b / 128)")" --momentum 0.9
  # LARS (eta 0.001) and LAMB: a few rates each, larger for the larger batch (LARS at 8 and
  # batch 1024 stalls at chance, so the sweep reaches below 3 instead).
  if ((b <= 1024)); then lars=(1 3 8) lamb=(0.01 0.02); else lars=(2 6) lamb=(0.02 0.04); fi
  for lr in "${lars[@]}"; do run lars "$b" "$lr" --momentum 0.9 --trust-coefficient 0.001; done
  for lr in "${lamb[@]}"; do run lamb "$b" "$lr"; done
done
