#!/usr/bin/env bash
# The same training whatever the layout: `tandem pretrain` normalises every step's loss by the
# real (non-padding) tokens of the whole global batch, so one worker with one pass, 2 DDP
# workers, one worker with --grad-accum 4, a 2-stage pipeline with 4 micro-batches, 4 ZeRO-1
# workers with --grad-accum 2, 2 tensor-parallel ranks, and 2 tensor-parallel ranks x 2 ZeRO-2
# and ZeRO-3 replicas must end at the same final and validation loss (the report's 6 decimals,
# within 2e-5); the ZeRO ones also follow one worker's loss at every step within 1e-5 relative,
# and so does `tandem finetune` (classification, from the first run's checkpoint) under the same
# two layouts. Documents padded to 96 tokens make
# the difference: weighting each micro-batch's or rank's own token mean instead (as DDP weights
# ranks) put these runs up to 1.3e-3 apart. The report names the accumulation.
# usage: text_grad_accum.sh TANDEM [DATA_DIR]
set -uo pipefail
tandem=$1
data=${2:-/usr/share/games/fortunes}
. "$(dirname "$0")/text_lib.sh"  # fails without the corpus; $tmp, fails=0, run/field/check
common=(--data "$data" --batch 16 --threads 1 --log-every 1000 --steps 12 --lr 3e-3 --warmup-steps 2 --seed 4
        --max-per-label 300 --vocab 200 --tokenizer-sentences 1000 --d-model 32 --heads 2 --layers 2 --seq 96)
run one "$tandem" pretrain -n 1 --strategy single --out "$tmp/a" --metrics "$tmp/one.jsonl" "${common[@]}"
run ddp2 "$tandem" pretrain -n 2 --strategy ddp --out "$tmp/b" "${common[@]}"
run one_k4 "$tandem" pretrain -n 1 --strategy single --grad-accum 4 --out "$tmp/c" "${common[@]}"
run pp2_m4 "$tandem" pretrain -n 2 --pp 2 --micro-batches 4 --out "$tmp/d" "${common[@]}"
run zero1_n4_k2 "$tandem" pretrain -n 4 --strategy zero1 --grad-accum 2 --out "$tmp/e" "${common[@]}"
run tp2 "$tandem" pretrain -n 2 --tp 2 --out "$tmp/f" "${common[@]}"
# ZeRO-2 and ZeRO-3 over the replicas of the tensor-parallel transformer (dp 2 x tp 2).
run tp2_zero2 "$tandem" pretrain -n 4 --tp 2 --strategy zero2 --out "$tmp/g" --metrics "$tmp/tp2_zero2.jsonl" "${common[@]}"
run tp2_zero3 "$tandem" pretrain -n 4 --tp 2 --strategy zero3 --out "$tmp/h" --metrics "$tmp/tp2_zero3.jsonl" "${common[@]}"
for other in ddp2 one_k4 pp2_m4 zero1_n4_k2 tp2 tp2_zero2 tp2_zero3; do
  for label in "final loss" "validation loss"; do
    a=$(num "$(field one "$label")"); b=$(num "$(field "$other" "$label")")
    check "one and $other: $label $a and $b" "abs($a - $b) <= 2e-5"
  done
done
ft=(--checkpoint "$tmp/a" --data "$data" --batch 16 --threads 1 --log-every 1000 --steps 12 --lr 2e-3 --warmup-steps 2
    --seed 4 --max-per-label 300 --no-eval)
run ft_one "$tandem" finetune -n 1 --strategy single --metrics "$tmp/ft_one.jsonl" "${ft[@]}"
run ft_tp2_zero2 "$tandem" finetune -n 4 --tp 2 --strategy zero2 --metrics "$tmp/ft_tp2_zero2.jsonl" "${ft[@]}"
run ft_tp2_zero3 "$tandem" finetune -n 4 --tp 2 --strategy zero3 --metrics "$tmp/ft_tp2_zero3.jsonl" "${ft[@]}"
same_steps one tp2_zero2 1e-5
same_steps one tp2_zero3 1e-5
same_steps ft_one ft_tp2_zero2 1e-5
same_steps ft_one ft_tp2_zero3 1e-5
grep -q "gradient accumulation: 4 micro-batches of about 4 per replica and step" "$tmp/one_k4.log" ||
  { echo "FAIL the report does not name the accumulation"; fails=$((fails + 1)); }
[ "$fails" -eq 0 ] || { echo "$fails failure(s)"; exit 1; }
echo "text loss normalisation and gradient accumulation ok"
