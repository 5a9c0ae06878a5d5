#!/usr/bin/env bash
# Gradient accumulation in `tandem pretrain` (--grad-accum K): one worker with 2 micro-batches
# must train as 2 DDP workers with one each (DDP averages the ranks' mean losses; accumulation
# weights the micro-batches' means the same way), and 2 ZeRO-1 workers with 2 micro-batches as
# 4 with one: the same final and validation loss (to the report's 4 decimals). The report names
# the accumulation. usage: text_grad_accum.sh TANDEM [DATA_DIR]
set -uo pipefail
tandem=$1
data=${2:-/usr/share/games/fortunes}
. "$(dirname "$0")/text_lib.sh"  # skips without the corpus; $tmp, fails=0, run/field/check
common=(--data "$data" --batch 16 --threads 1 --log-every 1000 --steps 12 --lr 3e-3 --warmup-steps 2 --seed 4
        --max-per-label 300 --vocab 200 --tokenizer-sentences 1000 --d-model 32 --heads 2 --layers 2 --seq 32)
run one_k2 "$tandem" pretrain -n 1 --strategy single --grad-accum 2 --out "$tmp/a" "${common[@]}"
run ddp2 "$tandem" pretrain -n 2 --strategy ddp --out "$tmp/b" "${common[@]}"
run zero1_k2 "$tandem" pretrain -n 2 --strategy zero1 --grad-accum 2 --out "$tmp/c" "${common[@]}"
run zero1_n4 "$tandem" pretrain -n 4 --strategy zero1 --out "$tmp/d" "${common[@]}"
for pair in "one_k2 ddp2" "zero1_k2 zero1_n4"; do
  set -- $pair
  for label in "final loss" "validation loss"; do
    a=$(num "$(field "$1" "$label")"); b=$(num "$(field "$2" "$label")")
    check "$1 and $2: $label $a and $b" "abs($a - $b) <= 2e-4"
  done
done
grep -q "gradient accumulation: 2 micro-batches per replica and step" "$tmp/one_k2.log" ||
  { echo "FAIL the report does not name the accumulation"; fails=$((fails + 1)); }
[ "$fails" -eq 0 ] || { echo "$fails failure(s)"; exit 1; }
echo "text gradient accumulation ok"
