#!/usr/bin/env bash
# Bad input to `tandem finetune --init-from` and `tandem export --to hf`: each case must exit
# non-zero, quickly, with a message naming the problem. The model directory is a tiny random
# Llama from tests/hf/hf_fixture.py; fails without .venv-hf or the fortunes corpus.
# usage: hf_bad_input.sh TANDEM SOURCE_DIR
set -uo pipefail
tandem=$1
src=$2
. "$src/tests/e2e/hf_lib.sh"
fails=0
expect() {  # expect NAME PATTERN -- command...: exits non-zero within 60 s, PATTERN on stderr
  local name=$1 pattern=$2; shift 3
  if "$src/tests/e2e/expect_run.sh" --exit nonzero --within 60 --stderr "$pattern" -- "$@" >"$tmp/out" 2>&1; then
    echo "ok   $name"
  else
    echo "FAIL $name:"; sed 's/^/    /' "$tmp/out" | tail -20
    fails=$((fails + 1))
  fi
}
printf '{"text": "one"}\n{"text": "two"}\n{"txt": "three"}\n' >"$tmp/no_text.jsonl"
printf '{"text": "one"}\nnot json\n' >"$tmp/not_json.jsonl"
for i in $(seq 1 30); do echo "{\"text\": \"cookie number $i\", \"label\": \"positive\"}"; done >"$tmp/cls.jsonl"
echo '{"text": "odd one", "label": "sarcastic"}' >>"$tmp/cls.jsonl"
for i in $(seq 1 30); do echo "{\"text\": \"cookie number $i\"}"; done >"$tmp/lm.jsonl"
cp -r "$tmp/fx/lm" "$tmp/no_width"
"$py" -c "import json,sys; c=json.load(open(sys.argv[1])); del c['hidden_size']; json.dump(c, open(sys.argv[1],'w'))" \
  "$tmp/no_width/config.json"
cp -r "$tmp/fx/lm" "$tmp/no_tok" && rm "$tmp/no_tok/tokenizer.model"
run=("$tandem" finetune -n 1 --strategy single --steps 2 --batch 2 --seq 16 --no-progress)
expect missing-dir "model directory '/nonexistent/model' not found" -- "${run[@]}" --init-from /nonexistent/model --data "$tmp/lm.jsonl"
expect no-hidden-size "hidden_size" -- "${run[@]}" --init-from "$tmp/no_width" --data "$tmp/lm.jsonl"
expect no-tokenizer "has no tokenizer.model" -- "${run[@]}" --init-from "$tmp/no_tok" --data "$tmp/lm.jsonl"
expect missing-data "data file '/nonexistent.jsonl' not found" -- "${run[@]}" --init-from "$tmp/fx/lm" --data /nonexistent.jsonl
expect no-text "no_text.jsonl:3: has no string field \"text\"" -- "${run[@]}" --init-from "$tmp/fx/lm" --data "$tmp/no_text.jsonl"
expect not-json "not_json.jsonl:2: not a JSON object" -- "${run[@]}" --init-from "$tmp/fx/lm" --data "$tmp/not_json.jsonl"
expect no-label "lm.jsonl:1: needs a \"label\"" -- "${run[@]}" --init-from "$tmp/fx/cls" --task classify --data "$tmp/lm.jsonl"
expect unknown-label "cls.jsonl:31: label 'sarcastic' is not one of the model's labels \{negative, neutral, positive\}" -- \
  "${run[@]}" --init-from "$tmp/fx/cls" --task classify --data "$tmp/cls.jsonl"
expect bad-task "--task 'regress' is not one of lm, classify" -- "${run[@]}" --init-from "$tmp/fx/lm" --task regress --data "$tmp/lm.jsonl"
expect tp-kv-heads "--tp 4: Llama: the tensor-parallel size 4 does not divide num_key_value_heads \(2\); use a --tp of 2" -- \
  "$tandem" finetune -n 4 --tp 4 --no-progress --init-from "$tmp/fx/lm" --data "$tmp/lm.jsonl"
# A --tp that divides no attention-head count is refused whatever the strategy, naming the sizes that fit.
expect tp-heads "--tp 3: Llama: the tensor-parallel size 3 does not divide num_attention_heads \(4\); use a --tp of 2" -- \
  "$tandem" finetune -n 3 --tp 3 --strategy zero3 --no-progress --init-from "$tmp/fx/lm" --data "$tmp/lm.jsonl"
expect tied-pp "ties its input and output embeddings, which a pipeline cannot split" -- "$tandem" finetune -n 2 --pp 2 \
  --batch 2 --steps 2 --no-progress --init-from "$tmp/fx/lm_tied" --data "$tmp/lm.jsonl"
# Sequence parallelism splits each sequence over the tp ranks: --seq must be a multiple of --tp.
expect sp-seq "--sequence-parallel splits each sequence over the --tp 2 ranks: --seq 31 must be a multiple of 2" -- \
  "$tandem" finetune -n 2 --tp 2 --sequence-parallel --seq 31 --no-progress --init-from "$tmp/fx/lm" --data "$tmp/lm.jsonl"
expect seq-too-long "--seq 4096 exceeds the model's max_position_embeddings 128" -- "$tandem" finetune -n 1 --strategy single \
  --no-progress --seq 4096 --init-from "$tmp/fx/lm" --data "$tmp/lm.jsonl"
# A checkpoint of another command (--resume with none at all starts at step 0, as tandem train).
"$tandem" train -n 1 --strategy single --model mlp --max-steps 1 --no-eval --no-progress --checkpoint-dir "$tmp/mlp" \
  --checkpoint-every 1 >"$tmp/mlp.log" 2>&1 || { echo "FAIL could not make an MLP checkpoint"; fails=$((fails + 1)); }
expect resume-other-command "--resume: checkpoint '.*' was not made by this command" -- "${run[@]}" --init-from "$tmp/fx/lm" \
  --data "$tmp/lm.jsonl" --checkpoint-dir "$tmp/mlp" --resume
"${run[@]}" --init-from "$tmp/fx/lm" --data "$tmp/lm.jsonl" --checkpoint-dir "$tmp/ck" >"$tmp/ck.log" 2>&1 ||
  { echo "FAIL could not make a checkpoint:"; tail "$tmp/ck.log"; fails=$((fails + 1)); }
expect resume-other-batch "--resume: checkpoint '.*' was saved with batch 2, this run has 4" -- \
  "$tandem" finetune -n 1 --strategy single --steps 3 --batch 4 --seq 16 --no-progress --init-from "$tmp/fx/lm" \
  --data "$tmp/lm.jsonl" --checkpoint-dir "$tmp/ck" --resume
expect export-missing "checkpoint '/nonexistent/ck' not found" -- "$tandem" export --to hf "$tmp/out" --checkpoint /nonexistent/ck
expect export-format "--to 'gguf' is not a known format; use --to hf" -- "$tandem" export --to gguf "$tmp/out" --checkpoint "$tmp"
expect export-empty "holds no complete checkpoint" -- "$tandem" export --to hf "$tmp/out" --checkpoint "$tmp/fx"
[ $fails -eq 0 ] && echo "all passed" || echo "$fails failed"
exit $((fails > 0))
