#!/usr/bin/env bash
# --tensorboard DIR on every training command, read back by TensorBoard's own EventAccumulator
# (tensorboard_check.py): the per-step loss, learning rate, throughput, gradient norm, loss
# scale, memory and communication share and the final figures equal the --metrics file of the
# same run, for `tandem train` (2 workers, DDP, clipping, test accuracy), `tandem pretrain`
# (validation loss), `tandem finetune` (2 workers, ZeRO-2, fp16 loss scaling) and `tandem
# finetune --init-from` (a tiny Llama, tensor parallel; a tiny Mixtral under --ep 2 with its
# load-balancing and z-losses); a run killed midway leaves its steps
# readable; a directory that cannot be made is refused, naming it, before training.
# Fails without .venv-hf (with tensorboard) or the fortunes corpus: both are test setup.
# usage: tensorboard.sh TANDEM SOURCE_DIR
set -uo pipefail
tandem=$1
src=$2
. "$(dirname "$0")/hf_lib.sh"  # $py, $tmp, the tiny Llama fixtures in $tmp/fx
"$py" -c "import tensorboard" 2>/dev/null || { echo "FAIL: no tensorboard in .venv-hf (run scripts/setup-hf-venv.sh)"; exit 1; }
check=$src/tests/e2e/tensorboard_check.py
fails=0
run() {  # run NAME REQUIRED_TAGS command...: trains with --metrics and --tensorboard, then compares
  local name=$1 req=$2; shift 2
  if ! timeout 240 "$@" --metrics "$tmp/$name.jsonl" --tensorboard "$tmp/tb_$name" >"$tmp/$name.log" 2>&1; then
    echo "FAIL $name:"; tail -20 "$tmp/$name.log" | sed 's/^/    /'; fails=$((fails + 1)); return
  fi
  "$py" "$check" "$tmp/tb_$name" "$tmp/$name.jsonl" --require "$req" || fails=$((fails + 1))
}
quiet=(--no-progress --threads 1)
run train train/loss,train/grad_norm,train/comm_share,final/test_accuracy \
  "$tandem" train -n 2 --max-steps 6 --batch 64 --eval-limit 500 --max-grad-norm 1 --no-baseline "${quiet[@]}"
text=(--max-per-label 100 --batch 8 --vocab 200 --d-model 32 --heads 2 --layers 2 --seq 16 --tokenizer-sentences 500)
run pretrain train/loss,final/eval_loss \
  "$tandem" pretrain -n 1 --steps 4 --eval-limit 40 --out "$tmp/ckpt" "${text[@]}" "${quiet[@]}"
run finetune train/loss,train/grad_norm,train/loss_scale,final/test_accuracy \
  "$tandem" finetune -n 2 --strategy zero2 --precision fp16 --max-grad-norm 1 --steps 4 --eval-limit 40 \
  --checkpoint "$tmp/ckpt" --max-per-label 100 --batch 8 "${quiet[@]}"
fortunes_jsonl "$tmp/lm.jsonl" 64
run init_from train/loss,final/eval_loss \
  "$tandem" finetune -n 2 --strategy ddp --tp 2 --init-from "$tmp/fx/lm" --data "$tmp/lm.jsonl" --seq 32 --batch 8 \
  --steps 4 --eval-limit 16 "${quiet[@]}"
# A mixture of experts (the tiny Mixtral, --ep 2): its load-balancing and router z-losses too.
run moe train/loss,train/aux_loss,train/z_loss \
  "$tandem" finetune -n 2 --ep 2 --init-from "$tmp/fx/mixtral" --data "$tmp/lm.jsonl" --seq 32 --batch 8 \
  --steps 3 --no-eval --moe-z-loss-coef 0.01 "${quiet[@]}"

# Killed midway (SIGKILL, nothing flushed at exit): the steps written so far read back whole.
"$tandem" train -n 1 --max-steps 100000 --batch 32 --no-eval --no-baseline "${quiet[@]}" \
  --tensorboard "$tmp/tb_killed" >"$tmp/killed.log" 2>&1 &
pid=$!
for _ in $(seq 600); do
  "$py" "$check" "$tmp/tb_killed" --at-least 3 >/dev/null 2>&1 && break
  sleep 0.2
done
kill -9 "$pid" 2>/dev/null
wait "$pid" 2>/dev/null
"$py" "$check" "$tmp/tb_killed" --at-least 3 || fails=$((fails + 1))

# A directory that cannot be made: a clear error naming it, a non-zero exit, no step trained.
touch "$tmp/file"
bad() {  # bad NAME command...
  local name=$1; shift
  if timeout 120 "$@" --tensorboard "$tmp/file/tb" >"$tmp/$name.log" 2>&1; then
    echo "FAIL $name: accepted --tensorboard under a file"; fails=$((fails + 1)); return
  fi
  if ! grep -q -- "--tensorboard $tmp/file/tb: cannot create the directory" "$tmp/$name.log" ||
    grep -qE "step [0-9]+/|loss [0-9]" "$tmp/$name.log"; then
    echo "FAIL $name: expected the --tensorboard error before training; got:"; tail -5 "$tmp/$name.log" | sed 's/^/    /'
    fails=$((fails + 1)); return
  fi
  echo "ok   $name: $(grep -m1 -- '--tensorboard' "$tmp/$name.log")"
}
bad bad_train "$tandem" train -n 2 --max-steps 2 --no-baseline "${quiet[@]}"
bad bad_pretrain "$tandem" pretrain -n 1 --steps 2 --out "$tmp/ckpt_bad" "${text[@]}" "${quiet[@]}"
bad bad_init_from "$tandem" finetune -n 1 --init-from "$tmp/fx/lm" --data "$tmp/lm.jsonl" --seq 32 --batch 8 --steps 2 \
  "${quiet[@]}"
[ $fails -eq 0 ] && echo "all TensorBoard checks passed" || echo "$fails check(s) failed"
exit $((fails > 0))
