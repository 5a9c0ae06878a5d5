#!/usr/bin/env bash
# Bad input to `tandem pretrain` / `tandem finetune`: each case must exit non-zero, quickly, with
# a message naming the problem: an empty corpus, a binary file, non-UTF-8 text, a tokenizer that
# does not match the checkpoint, a label set that differs from the checkpoint's.
# usage: text_bad_input.sh TANDEM
set -uo pipefail
tandem=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
expect() {  # expect NAME PATTERN -- command...
  local name=$1 pattern=$2; shift 3
  local start=$SECONDS
  timeout 120 "$@" >"$tmp/out" 2>&1
  local rc=$?
  if [ $rc -eq 0 ] || [ $rc -eq 124 ] || ! grep -qE -- "$pattern" "$tmp/out"; then
    echo "FAIL $name (exit $rc, $((SECONDS - start)) s); output:"; sed 's/^/    /' "$tmp/out" | tail -20
    fails=$((fails + 1))
  else
    echo "ok   $name (exit $rc, $((SECONDS - start)) s): $(grep -m1 -E -- "$pattern" "$tmp/out")"
  fi
}
# A small synthetic corpus of three "languages", valid UTF-8.
python3 - "$tmp/good" <<'PY'
import os, random, sys
root = sys.argv[1]
random.seed(1)
alphabets = {"": "abcdefghijklmnopqrstuvwxyz", "de": "abcdefghijklmnopqrstuvwxyzäöüß", "ru": "абвгдежзийклмнопрстуфхцчшщыэюя"}
for label, letters in alphabets.items():
    d = os.path.join(root, label)
    os.makedirs(d, exist_ok=True)
    docs = [" ".join("".join(random.choice(letters) for _ in range(random.randint(2, 7)))
                     for _ in range(random.randint(4, 12))) for _ in range(300)]
    open(os.path.join(d, "cookies"), "w", encoding="utf-8").write("\n%\n".join(docs) + "\n%\n")
PY
small=(--d-model 16 --heads 2 --layers 1 --seq 16 --batch 8 --steps 3 --no-progress)
if ! timeout 120 "$tandem" pretrain -n 1 --strategy single --data "$tmp/good" --out "$tmp/ckpt" "${small[@]}" --vocab 120 >"$tmp/pre.log" 2>&1; then
  echo "FAIL could not pre-train the reference checkpoint:"; tail -20 "$tmp/pre.log"; exit 1
fi
timeout 120 "$tandem" pretrain -n 1 --strategy single --data "$tmp/good" --out "$tmp/ckpt_other" "${small[@]}" --vocab 100 >"$tmp/pre2.log" 2>&1 ||
  { echo "FAIL could not pre-train the second checkpoint:"; tail -20 "$tmp/pre2.log"; exit 1; }

mkdir -p "$tmp/empty" "$tmp/blank"
: >"$tmp/blank/cookies"; printf '%%\n  \n%%\n' >"$tmp/blank/seps"
expect empty-dir "no documents in" -- "$tandem" pretrain -n 1 --strategy single --data "$tmp/empty" --out "$tmp/x" "${small[@]}"
expect only-separators "no documents in" -- "$tandem" finetune -n 1 --strategy single --data "$tmp/blank" --checkpoint "$tmp/ckpt" "${small[@]}"
expect missing-dir "text directory '/nonexistent' not found.*apt-get install fortunes" -- \
  "$tandem" pretrain -n 1 --strategy single --data /nonexistent --out "$tmp/x" "${small[@]}"
cp -r "$tmp/good" "$tmp/binary"; head -c 3000 /bin/sh >"$tmp/binary/de/blob"
expect binary "blob' is binary" -- "$tandem" finetune -n 2 --strategy ddp --data "$tmp/binary" --checkpoint "$tmp/ckpt" "${small[@]}"
cp -r "$tmp/good" "$tmp/latin1"; printf 'Gr\xfc\xdf Gott\n%%\n' >"$tmp/latin1/de/latin1"
expect non-utf8 "latin1' is not UTF-8 \(invalid byte 0xfc at offset 2\)" -- \
  "$tandem" pretrain -n 1 --strategy single --data "$tmp/latin1" --out "$tmp/x" "${small[@]}"
expect wrong-tokenizer "does not match checkpoint" -- "$tandem" finetune -n 1 --strategy single --data "$tmp/good" \
  --checkpoint "$tmp/ckpt" --tokenizer "$tmp/ckpt_other/tokenizer.model" "${small[@]}"
cp -r "$tmp/ckpt" "$tmp/ckpt_swapped"; cp "$tmp/ckpt_other/tokenizer.model" "$tmp/ckpt_swapped/tokenizer.model"
expect swapped-tokenizer "does not match checkpoint" -- "$tandem" finetune -n 2 --strategy zero2 --data "$tmp/good" \
  --checkpoint "$tmp/ckpt_swapped" "${small[@]}"
echo "not a model" >"$tmp/junk.model"
expect junk-tokenizer "not a SentencePiece model" -- "$tandem" finetune -n 1 --strategy single --data "$tmp/good" \
  --checkpoint "$tmp/ckpt" --tokenizer "$tmp/junk.model" "${small[@]}"
mkdir -p "$tmp/fewer"; cp -r "$tmp/good/de" "$tmp/good/ru" "$tmp/fewer/"
expect label-set "labels of .*\{de,ru\}.* differ from those of checkpoint .*\{de,en,ru\}" -- \
  "$tandem" finetune -n 1 --strategy single --data "$tmp/fewer" --checkpoint "$tmp/ckpt" "${small[@]}"
expect no-checkpoint "has no manifest.json" -- "$tandem" finetune -n 1 --strategy single --data "$tmp/good" --checkpoint "$tmp/empty" "${small[@]}"
expect single-with-many "strategy single runs one worker" -- "$tandem" finetune -n 2 --strategy single --data "$tmp/good" --checkpoint "$tmp/ckpt"
expect bad-pp-partition "--pp-partition '2,x': use params, time, or the layers of each of the 2 stages" -- \
  "$tandem" finetune -n 2 --strategy ddp --pp 2 --pp-partition 2,x --data "$tmp/good" --checkpoint "$tmp/ckpt" "${small[@]}"
expect short-pp-partition "the partition covers 3 layers but the model has" -- \
  "$tandem" finetune -n 2 --strategy ddp --pp 2 --pp-partition 1,2 --data "$tmp/good" --checkpoint "$tmp/ckpt" "${small[@]}"
expect sp-without-tp "--sequence-parallel splits the sequence over the tensor-parallel ranks and needs --tp 2 or more" -- \
  "$tandem" pretrain -n 1 --strategy single --sequence-parallel --data "$tmp/good" --out "$tmp/x" "${small[@]}"
expect sp-pretrain "--sequence-parallel needs a Llama model" -- \
  "$tandem" pretrain -n 2 --strategy ddp --tp 2 --sequence-parallel --data "$tmp/good" --out "$tmp/x" "${small[@]}"
expect grad-accum-pp "--grad-accum with --pp: the pipeline already accumulates" -- \
  "$tandem" finetune -n 2 --strategy ddp --pp 2 --grad-accum 2 --data "$tmp/good" --checkpoint "$tmp/ckpt" "${small[@]}"
expect grad-accum-batch "fewer than --grad-accum 64" -- \
  "$tandem" finetune -n 2 --strategy ddp --grad-accum 64 --data "$tmp/good" --checkpoint "$tmp/ckpt" "${small[@]}"
# Checkpoints and elastic runs.
ft=(--data "$tmp/good" --checkpoint "$tmp/ckpt" "${small[@]}")
unbatched=(--d-model 16 --heads 2 --layers 1 --seq 16 --steps 3 --no-progress)
expect resume-no-dir "--resume needs --checkpoint-dir DIR" -- "$tandem" finetune -n 1 --strategy single --resume "${ft[@]}"
expect async-no-every "--checkpoint-async needs --checkpoint-every N" -- \
  "$tandem" finetune -n 1 --strategy single --checkpoint-dir "$tmp/ck" --checkpoint-async "${ft[@]}"
expect elastic-no-checkpoints "-n 1:2 \(elastic\) relaunches from checkpoints: give --checkpoint-dir DIR and --checkpoint-every N" -- \
  "$tandem" finetune -n 1:2 "${ft[@]}"
expect elastic-batch "-n 2:3: no worker count from 2 to 3 can run this job.*--batch 7 must split evenly" -- \
  "$tandem" pretrain -n 2:3 --data "$tmp/good" --out "$tmp/o" "${unbatched[@]}" --batch 7 --checkpoint-dir "$tmp/ck" --checkpoint-every 2
expect elastic-lr-unknown "--elastic-lr 'sideways' is not one of keep, scale" -- \
  "$tandem" finetune -n 1:2 --elastic-lr sideways --checkpoint-dir "$tmp/ck" --checkpoint-every 2 "${ft[@]}"
mkdir -p "$tmp/ck_pre"
timeout 120 "$tandem" pretrain -n 1 --strategy single --data "$tmp/good" --out "$tmp/o2" "${small[@]}" --vocab 120 \
  --checkpoint-dir "$tmp/ck_pre" >"$tmp/pre3.log" 2>&1 || { echo "FAIL pretrain with --checkpoint-dir"; fails=$((fails + 1)); }
expect resume-other-batch "was saved with batch 8, this run has 4; resume with the same batch" -- \
  "$tandem" pretrain -n 1 --strategy single --data "$tmp/good" --out "$tmp/o3" "${unbatched[@]}" --vocab 120 --batch 4 \
  --checkpoint-dir "$tmp/ck_pre" --resume
expect resume-other-command "was saved with command \"pretrain\", this run has \"finetune\"" -- \
  "$tandem" finetune -n 1 --strategy single "${ft[@]}" --checkpoint-dir "$tmp/ck_pre" --resume
[ $fails -eq 0 ] && echo "all bad-input cases rejected" || echo "$fails case(s) not rejected as expected"
exit $((fails > 0))
