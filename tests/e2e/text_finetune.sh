#!/usr/bin/env bash
# `tandem pretrain` then `tandem finetune` on the fortune-cookie corpus (7 languages), as a user
# runs them: pre-training on 1 and 2 workers, fine-tuning with single, ddp and zero2 (2 workers)
# and from scratch. Checks: ddp and zero2 test accuracy within 1 point of single, single above 80%;
# prints the times side by side and the pre-trained vs from-scratch accuracies.
# usage: text_finetune.sh TANDEM [DATA_DIR]
set -uo pipefail
tandem=$1
data=${2:-/usr/share/games/fortunes}
. "$(dirname "$0")/text_lib.sh"  # fails without the corpus; $tmp, fails=0, run/field/check
# Small and bounded: d_model 64, 2 layers, seq 64, vocabulary 2000, 1200 documents per language.
common=(--data "$data" --max-per-label 1200 --batch 32 --no-progress --log-every 100)
shape=(--vocab 2000 --d-model 64 --heads 4 --layers 2 --seq 64)

run pretrain_1 "$tandem" pretrain -n 1 --strategy single --steps 100 --lr 2e-3 --out "$tmp/ckpt" "${common[@]}" "${shape[@]}"
run pretrain_2 "$tandem" pretrain -n 2 --strategy ddp --steps 100 --lr 2e-3 --out "$tmp/ckpt2" "${common[@]}" "${shape[@]}"
[ -f "$tmp/ckpt/model.pt" ] && [ -f "$tmp/ckpt/tokenizer.model" ] && [ -f "$tmp/ckpt/manifest.json" ] ||
  { echo "FAIL checkpoint files missing: $(ls "$tmp/ckpt" 2>&1)"; fails=$((fails + 1)); }
ft=(--steps 80 --lr 1e-3 --warmup-steps 10 "${common[@]}")
run single "$tandem" finetune -n 1 --strategy single --checkpoint "$tmp/ckpt" "${ft[@]}"
run ddp "$tandem" finetune -n 2 --strategy ddp --checkpoint "$tmp/ckpt" "${ft[@]}"
run zero2 "$tandem" finetune -n 2 --strategy zero2 --checkpoint "$tmp/ckpt" "${ft[@]}"
run scratch "$tandem" finetune -n 1 --strategy single --checkpoint "$tmp/ckpt" --from-scratch "${ft[@]}"
grep -A12 "^test accuracy" "$tmp/single.log" | sed 's/^/    /'

acc_single=$(field single "test accuracy"); acc_ddp=$(field ddp "test accuracy")
acc_zero2=$(field zero2 "test accuracy"); acc_scratch=$(field scratch "test accuracy")
echo
echo "                 pretrain 100 steps   finetune 80 steps   test accuracy"
printf "single, 1 worker  %8s s          %8s s          %s %%\n" "$(field pretrain_1 "wall time")" "$(field single "wall time")" "$acc_single"
printf "ddp, 2 workers    %8s s          %8s s          %s %%\n" "$(field pretrain_2 "wall time")" "$(field ddp "wall time")" "$acc_ddp"
printf "zero2, 2 workers  %8s            %8s s          %s %%\n" "-" "$(field zero2 "wall time")" "$acc_zero2"
printf "from scratch      %8s            %8s s          %s %%\n" "-" "$(field scratch "wall time")" "$acc_scratch"
echo "(wall time: training loop only)"

a1=$(num "$acc_single"); a2=$(num "$acc_ddp"); a3=$(num "$acc_zero2"); a4=$(num "$acc_scratch")
check "single reaches 80% ($a1)" "float('$a1') >= 80"
check "ddp within 1 point of single ($a2 vs $a1)" "abs(float('$a2') - float('$a1')) <= 1.0"
check "zero2 within 1 point of single ($a3 vs $a1)" "abs(float('$a3') - float('$a1')) <= 1.0"
# Not asserted here: after 100 pre-training steps and 80 fine-tuning steps both starts reach about
# the same accuracy; e2e_text_pretrained_beats_scratch (text_pretrain_gap.sh) asserts the gap
# where pre-training matters (few fine-tuning steps). Printed for the record.
echo "info pre-trained $a1 % vs from scratch $a4 % after the same fine-tuning steps"
check "report has a confusion table" "$(grep -c '^confusion' "$tmp/single.log") == 1"
[ $fails -eq 0 ] && echo "all text fine-tuning checks passed" || echo "$fails check(s) failed"
exit $((fails > 0))
