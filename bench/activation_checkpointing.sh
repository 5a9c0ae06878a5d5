#!/usr/bin/env bash
# Peak memory and step time of tandem pretrain's transformer (8 blocks, width 256, 256 tokens)
# with and without --activation-checkpointing every, under ddp and zero3 on 2 workers. The
# variants run interleaved (A B B A per strategy) so that a change of machine speed hits both.
# Usage: bench/activation_checkpointing.sh [tandem binary] [fortune corpus]
set -euo pipefail
tandem=${1:-build/tandem}
data=${2:-/usr/share/games/fortunes}
out=$(mktemp -d)
common=(--data "$data" --batch 32 --threads 1 --steps 6 --lr 1e-3 --warmup-steps 2 --seed 4 --max-per-label 300
        --vocab 500 --tokenizer-sentences 2000 --d-model 256 --heads 4 --layers 8 --seq 256 --no-progress --no-eval)
printf "%-8s %-6s %12s %12s %12s %12s\n" strategy recompute "rank0 MiB" "rank1 MiB" "median ms" "final loss"
for s in ddp zero3; do
  for ac in none every every none; do
    "$tandem" pretrain -n 2 --strategy "$s" --activation-checkpointing "$ac" --out "$out/ckpt" "${common[@]}" >"$out/log" 2>&1
    mem=$(grep -m1 '^peak memory' "$out/log" | sed -E 's/.*rank 0 ([0-9]+) MiB, rank 1 ([0-9]+) MiB.*/\1 \2/')
    ms=$(grep -m1 '^throughput' "$out/log" | sed -E 's/.*median step ([0-9.]+) ms.*/\1/')
    loss=$(grep -m1 '^final loss' "$out/log" | awk '{print $3}')
    printf "%-8s %-6s %12s %12s %12s %12s\n" "$s" "$ac" $mem "$ms" "$loss"
  done
done
