#!/usr/bin/env bash
# Fine-tuning from `tandem pretrain`'s checkpoint beats training from scratch for the same steps.
# A causal LM pre-trained for 200 steps (2 workers, ddp) on the 7-language fortune corpus, then
# 10 fine-tuning steps (320 labelled documents) from its weights and from random weights (same
# tokenizer, shape, seed, data order). Language identification from scratch needs more than 10
# steps to learn which pieces belong to which language; the pre-trained embeddings already group
# them. Measured by hand (pretrain seed = fine-tune seed = 1, 2, 3; loaded 2-core machine):
# pre-trained 83.5 / 75.5 / 73.1 %, from scratch 34.0 / 52.4 / 37.4 % (860 test documents), gaps
# 49.5 / 23.0 / 35.7 points. Asserts a gap of at least 15 points and the pre-trained run above 60 %.
# usage: text_pretrain_gap.sh TANDEM [DATA_DIR] [SEED]
set -uo pipefail
tandem=$1
data=${2:-/usr/share/games/fortunes}
seed=${3:-1}
. "$(dirname "$0")/text_lib.sh"  # fails without the corpus; $tmp, fails=0, run/field/check
# Small enough for ~1 minute on 2 cores: vocabulary 500 (the LM head dominates a step), seq 32,
# d_model 64, 2 layers; the tokenizer trains on 3000 documents. One thread per worker: the
# machine has 2 cores, and threads beyond them slow every step down many times over.
common=(--data "$data" --max-per-label 1200 --batch 32 --threads 1 --seed "$seed" --no-progress)
run pretrain "$tandem" pretrain -n 2 --strategy ddp --steps 200 --lr 5e-3 --warmup-steps 20 --out "$tmp/ckpt" \
  --vocab 500 --tokenizer-sentences 3000 --d-model 64 --heads 4 --layers 2 --seq 32 "${common[@]}"
ft=(-n 1 --strategy single --checkpoint "$tmp/ckpt" --steps 10 --lr 2e-3 --warmup-steps 5 "${common[@]}")
# Side by side (one thread each on the 2 cores); a failed run shows up as a missing figure.
run pretrained "$tandem" finetune "${ft[@]}" &
run scratch "$tandem" finetune "${ft[@]}" --from-scratch &
wait
grep -q "^initialised      from checkpoint" "$tmp/pretrained.log" || { echo "FAIL the pre-trained run did not load the checkpoint"; fails=$((fails + 1)); }
grep -q "^initialised      at random" "$tmp/scratch.log" || { echo "FAIL the scratch run was not initialised at random"; fails=$((fails + 1)); }
a=$(num "$(field pretrained "test accuracy")"); b=$(num "$(field scratch "test accuracy")")
echo "pre-training: $(grep -E '^(wall time|validation loss)' "$tmp/pretrain.log" | tr -s ' ' | tr '\n' ';')"
echo "after 10 fine-tuning steps: pre-trained $a %, from scratch $b %"
check "pre-trained start reaches 60% ($a)" "float('$a') >= 60"
check "pre-trained beats from scratch by at least 15 points ($a vs $b)" "float('$a') - float('$b') >= 15"
[ $fails -eq 0 ] && echo "pre-trained beats from scratch" || echo "$fails check(s) failed"
exit $((fails > 0))
