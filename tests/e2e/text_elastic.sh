#!/usr/bin/env bash
# Elastic `tandem pretrain -n 1:2` on 2 network-namespace hosts: after the first checkpoint host
# 1's link goes down for good; the launcher must drop it, relaunch 1 worker on host 0 from the
# newest checkpoint (the tokenizer kept beside the checkpoints) and finish. Its per-step losses
# after the cut must equal (1e-6) those of a manual `--resume` on 1 worker from a copy of that
# checkpoint. MODE is --elastic-lr: keep (the worker takes the whole global batch at the same
# learning rate) or scale (it keeps its share: global batch and learning rate halve, and the
# manual resume is given the same).
# usage: text_elastic.sh TANDEM NET_ID keep|scale [DATA_DIR]   (exit 77: no netns; no corpus fails)
set -euo pipefail
tandem=$1
NET_ID=$2
mode=$3
data=${4:-/usr/share/games/fortunes}
[[ -d $data ]] || { echo "FAIL: no corpus at $data (apt-get install fortunes; scripts/setup.sh does)"; exit 1; }
source "$(dirname "$0")/elastic_lib.sh"
steps=200
text_common=(--data "$data" --threads 1 --no-progress --no-eval --steps "$steps" --warmup-steps 5 --seed 4
             --max-per-label 60 --vocab 200 --tokenizer-sentences 1000 --d-model 32
             --heads 2 --layers 1 --seq 32 --checkpoint-every 20 --elastic-lr "$mode")

mn_launch "$tandem" pretrain -n 1:2 --hostfile "$out/hostfile" --net-if "$mn_net" "${text_common[@]}" --batch 8 --lr 3e-3 \
  --checkpoint-dir "$out/ck" --out "$out/model" --timeout 6 --metrics "$out/elastic.jsonl" \
  >"$out/stdout" 2>"$out/stderr" &
job=$!
el_cut_after 20 90
el_wait_ok
resumed=$(grep -oE "2 -> 1 workers \(failure\); lost $h1; resuming from step [0-9]+" "$out/stdout" | head -n1 |
  grep -oE "[0-9]+$") || el_fail "no membership change 2 -> 1 naming $h1"
[[ -f $out/model/model.pt ]] || el_fail "the finished run wrote no --out model"
want_batch=8
[[ $mode == scale ]] && want_batch=4
grep -qE "^steps +$((steps - resumed)) \(global batch $want_batch," "$out/stdout" ||
  el_fail "the relaunch on 1 worker did not run $((steps - resumed)) steps at global batch $want_batch"

manual=(--batch 8 --lr 3e-3)
[[ $mode == scale ]] && manual=(--batch 4 --lr 1.5e-3)
mkdir -p "$out/manual"
cp -r "$out/ck/step-$(printf '%08d' "$resumed")" "$out/ck/tokenizer.model" "$out/manual/"
"$tandem" pretrain -n 1 "${text_common[@]}" "${manual[@]}" --checkpoint-dir "$out/manual" --resume \
  --out "$out/manual-model" --metrics "$out/manual.jsonl" >"$out/stdout-manual" 2>&1 ||
  el_fail "the manual --resume failed: $(tail -n 5 "$out/stdout-manual")"
el_compare_losses "$resumed" 1 2:1
echo "text elastic ($mode) ok"
