#!/usr/bin/env bash
# Checkpoints and --resume of `tandem pretrain` and `tandem finetune`: a run stopped at a
# checkpoint (the elastic launcher's stop file) and resumed continues the uninterrupted run's
# data order and learning-rate schedule (the checkpoint holds the step and the sampler
# position), so its per-step losses equal the uninterrupted run's within 1e-6 on the same 2
# workers. Resumed on 1 worker instead, the global batch's loss is summed on one rank instead of
# two, a float32 rounding difference that Adam carries forward: within 2e-5, the bound
# e2e_text_grad_accum holds for layouts of the same global batch. The uninterrupted run writes
# --out as without checkpoints, saves the last step and keeps the newest --keep 2; the stopped
# one writes no --out and deletes the stop file. Its checkpoint also resumes under tp 2 x ZeRO-3
# on 4 workers (within 2e-5) and that run writes --out.
# usage: text_resume.sh TANDEM [DATA_DIR]
set -uo pipefail
tandem=$1
data=${2:-/usr/share/games/fortunes}
. "$(dirname "$0")/text_lib.sh"  # fails without the corpus; $tmp, fails=0, run/field/check
common=(--data "$data" --batch 8 --threads 1 --no-progress --steps 10 --lr 3e-3 --warmup-steps 2 --seed 4
        --max-per-label 60 --eval-limit 16 --checkpoint-every 3)
shape=(--vocab 200 --tokenizer-sentences 1000 --d-model 32 --heads 2 --layers 1 --seq 32)
# same A B TOL: the losses of B (a resumed run's metrics) equal A's last ones within TOL.
same() {
  if python3 - "$(dirname "$0")" "$tmp/$1.jsonl" "$tmp/$2.jsonl" "$3" <<'PY'; then
import sys
sys.path.insert(0, sys.argv[1])
from metrics import load
a, _ = load(sys.argv[2]); b, _ = load(sys.argv[3]); tol = float(sys.argv[4])
start = len(a) - len(b)
assert len(b) > 0 and start >= 0, f"{len(a)} and {len(b)} steps"
worst = max(abs(x - y) for x, y in zip(a[start:], b))
print(f"     steps {start + 1}-{len(a)}: worst per-step loss difference {worst:.2e}")
assert worst <= tol
PY
    echo "ok   $2 continues $1 within $3"
  else
    echo "FAIL $2 does not continue $1 within $3"; fails=$((fails + 1))
  fi
}
steps_in() { (cd "$1" && ls -d step-* | tr '\n' ' '); }

# Pre-training: uninterrupted; stopped at step 3 and resumed on 2 workers; resumed on 1.
run pre "$tandem" pretrain -n 2 --out "$tmp/pre" --checkpoint-dir "$tmp/ck" --keep 2 --metrics "$tmp/pre.jsonl" \
  "${common[@]}" "${shape[@]}" || exit 1
[ -f "$tmp/pre/model.pt" ] && [ -f "$tmp/pre/manifest.json" ] || { echo "FAIL no model in --out"; fails=$((fails + 1)); }
check "--keep 2 kept step 9 and the last step: $(steps_in "$tmp/ck")" "'$(steps_in "$tmp/ck")' == 'step-00000009 step-00000010 '"
# Asynchronous saves: the same losses, the same checkpoints kept, each shard the same bytes.
run pre_async "$tandem" pretrain -n 2 --out "$tmp/pre_a" --checkpoint-dir "$tmp/ck_a" --keep 2 --checkpoint-async \
  --metrics "$tmp/pre_async.jsonl" "${common[@]}" "${shape[@]}" && same pre pre_async 0
check "--checkpoint-async kept $(steps_in "$tmp/ck_a")" "'$(steps_in "$tmp/ck_a")' == '$(steps_in "$tmp/ck")'"
for f in "$tmp"/ck/step-00000010/shard-*.bin; do
  cmp -s "$f" "$tmp/ck_a/step-00000010/$(basename "$f")" || { echo "FAIL $(basename "$f") differs when written asynchronously"; fails=$((fails + 1)); }
done
touch "$tmp/stop"
run stopped "$tandem" pretrain -n 2 --out "$tmp/pre_s" --checkpoint-dir "$tmp/ck_s" --elastic-stop-file "$tmp/stop" \
  --metrics "$tmp/stopped.jsonl" "${common[@]}" "${shape[@]}"
check "the stopped run ends at step 3 ($(steps_in "$tmp/ck_s")), deletes the stop file, writes no --out" \
  "'$(steps_in "$tmp/ck_s")' == 'step-00000003 ' and not $([ -e "$tmp/stop" ] && echo True || echo False) and not $([ -e "$tmp/pre_s/model.pt" ] && echo True || echo False)"
mkdir -p "$tmp/ck_1" "$tmp/ck_tp" && cp -r "$tmp/ck_s/." "$tmp/ck_1/" && cp -r "$tmp/ck_s/." "$tmp/ck_tp/"
run resumed "$tandem" pretrain -n 2 --out "$tmp/pre_s" --checkpoint-dir "$tmp/ck_s" --resume \
  --metrics "$tmp/resumed.jsonl" "${common[@]}" "${shape[@]}" && same pre resumed 1e-6
[ -f "$tmp/pre_s/model.pt" ] || { echo "FAIL the resumed run wrote no --out"; fails=$((fails + 1)); }
run resumed_1 "$tandem" pretrain -n 1 --strategy single --out "$tmp/pre_1" --checkpoint-dir "$tmp/ck_1" --resume \
  --metrics "$tmp/resumed_1.jsonl" "${common[@]}" "${shape[@]}" && same pre resumed_1 2e-5
# The same checkpoint under tp 2 x ZeRO-3 over 2 replicas: each rank reads its block's chunk, saves
# its own pieces, and the whole model is written to --out.
run resumed_tp "$tandem" pretrain -n 4 --tp 2 --strategy zero3 --out "$tmp/pre_tp" --checkpoint-dir "$tmp/ck_tp" \
  --resume --metrics "$tmp/resumed_tp.jsonl" "${common[@]}" "${shape[@]}" && same pre resumed_tp 2e-5
[ -f "$tmp/pre_tp/model.pt" ] || { echo "FAIL the tp x zero3 run wrote no --out"; fails=$((fails + 1)); }

# Fine-tuning from the pre-trained model: uninterrupted; stopped at step 3 and resumed.
ft=(--checkpoint "$tmp/pre" --data "$data" --batch 8 --threads 1 --no-progress --steps 6 --lr 1e-3 --warmup-steps 2
    --seed 4 --max-per-label 60 --eval-limit 16 --checkpoint-every 3)
run ft "$tandem" finetune -n 2 --checkpoint-dir "$tmp/ft" --metrics "$tmp/ft.jsonl" "${ft[@]}"
touch "$tmp/stop"
run ft_stopped "$tandem" finetune -n 2 --checkpoint-dir "$tmp/ft_s" --elastic-stop-file "$tmp/stop" "${ft[@]}"
run ft_resumed "$tandem" finetune -n 2 --checkpoint-dir "$tmp/ft_s" --resume --metrics "$tmp/ft_resumed.jsonl" \
  "${ft[@]}" && same ft ft_resumed 1e-6
[ "$fails" -eq 0 ] || { echo "$fails failure(s)"; exit 1; }
echo "text checkpoints and resume ok"
