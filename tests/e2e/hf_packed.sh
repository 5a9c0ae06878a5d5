#!/usr/bin/env bash
# `tandem preprocess` and `tandem finetune --init-from MODEL --data DIR` (packed windows read by
# mmap) on a tiny random Llama: Megatron-LM's own IndexedDataset reads the files, each document
# transformers' ids + EOS; what every rank trained on (--data-record) is the .bin's packed windows
# with Megatron's reset positions (tests/e2e/packed_reference.py, numpy); a run stopped at a
# checkpoint on 2 workers, resumed on 1, then on 4 trains every sample once over 3 epochs (each
# epoch each window once) and the same windows as an uninterrupted run; zero3, tp2 (and with
# --sequence-parallel) and the tied LM follow one worker's losses. Bad input is refused naming
# the problem: a JSON line that is not an object (FILE:LINE), --pp 2, --cp 2, --task classify, a
# truncated index, a dataset of another tokenizer, a directory that is not a dataset.
# usage: hf_packed.sh TANDEM SOURCE_DIR
set -uo pipefail
tandem=$1
src=$2
. "$src/tests/e2e/hf_lib.sh"
fortunes_jsonl "$tmp/c.jsonl" 60
fails=0
ref=("$py" "$src/tests/e2e/packed_reference.py")

if ! timeout 120 "$tandem" preprocess --init-from "$tmp/fx/lm" --data "$tmp/c.jsonl" --out "$tmp/d" --threads 2 \
  >"$tmp/pre.log" 2>&1; then
  echo "FAIL preprocess:"; tail -5 "$tmp/pre.log"; exit 1
fi
grep preprocessed "$tmp/pre.log"
"${ref[@]}" megatron "$tmp/d" "$tmp/fx/lm" "$tmp/c.jsonl" 2>/dev/null || fails=$((fails + 1))

pk=(--init-from "$tmp/fx/lm" --data "$tmp/d" --seq 64 --batch 8 --lr 1e-3 --warmup-steps 2)
# The data order: one uninterrupted run, and 2 workers -> (stop at step 6) 1 worker -> (step 20) 4.
run whole -n 1 --strategy single "${pk[@]}" --steps 30 --data-record "$tmp/rec_whole"
run part1 -n 2 "${pk[@]}" --steps 6 --checkpoint-dir "$tmp/ck" --checkpoint-every 3 --data-record "$tmp/rec1"
run part2 -n 1 "${pk[@]}" --steps 20 --checkpoint-dir "$tmp/ck" --checkpoint-every 7 --resume --data-record "$tmp/rec2"
run part3 -n 4 "${pk[@]}" --steps 30 --checkpoint-dir "$tmp/ck" --resume --data-record "$tmp/rec3"
grep -h resuming "$tmp/part2.log" "$tmp/part3.log"
"${ref[@]}" record "$tmp/d" 64 8 "$tmp/rec1@0" "$tmp/rec2@6" "$tmp/rec3@20" --ref "$tmp/rec_whole" 2>/dev/null ||
  fails=$((fails + 1))
"$py" - "$tmp/ck/step-00000020/manifest.json" <<'PY' || fails=$((fails + 1))
import json, sys
d = json.load(open(sys.argv[1]))["extra"]["data"]
n = d["samples_per_epoch"]
ok = d == {"epoch": 160 // n, "index": 160 % n, "samples_per_epoch": n} and 160 // n >= 1
print(f"{'ok  ' if ok else 'FAIL'} the step-20 checkpoint records the data loader at {d}")
sys.exit(0 if ok else 1)
PY

# Layouts: the same packed batches, the same losses.
run single -n 1 --strategy single "${pk[@]}" --steps 20
run zero3 -n 2 --strategy zero3 "${pk[@]}" --steps 20 && same single zero3
run tp2 -n 2 --tp 2 "${pk[@]}" --steps 20 && same single tp2
run tp2_sp -n 2 --tp 2 --sequence-parallel "${pk[@]}" --steps 20 && same single tp2_sp
run recompute -n 2 --activation-checkpointing every "${pk[@]}" --steps 20 && same single recompute
run selective -n 2 --activation-checkpointing selective "${pk[@]}" --steps 20 && same single selective
tied=(--init-from "$tmp/fx/lm_tied" --data "$tmp/d" --seq 64 --batch 8 --lr 1e-3 --warmup-steps 2 --steps 20)
run tied_single -n 1 --strategy single "${tied[@]}" && run tied_tp2 -n 2 --tp 2 "${tied[@]}" && same tied_single tied_tp2

# Bad input.
cp "$tmp/c.jsonl" "$tmp/bad.jsonl"
sed -i '3s/.*/{"text": 5}/' "$tmp/bad.jsonl"
refused bad_line "bad.jsonl:3: has no string field \"text\"" "$tandem" preprocess --init-from "$tmp/fx/lm" \
  --data "$tmp/bad.jsonl" --out "$tmp/bad_out"
refused pp2 "--pp 2" "$tandem" finetune "${pk[@]}" -n 2 --pp 2 --steps 2 --no-progress
refused cp2 "--cp 2" "$tandem" finetune "${pk[@]}" -n 2 --cp 2 --steps 2 --no-progress
refused classify "for --task lm" "$tandem" finetune "${pk[@]}" --task classify -n 1 --steps 2 --no-progress
cp -r "$tmp/d" "$tmp/cut"
truncate -s -8 "$tmp/cut/text_document.idx"
refused truncated "text_document.idx': truncated" "$tandem" finetune --init-from "$tmp/fx/lm" --data "$tmp/cut" --seq 64 -n 1 --steps 2
cp -r "$tmp/d" "$tmp/other"
sed -i 's/"vocab_size": 800/"vocab_size": 32000/' "$tmp/other/dataset.json"
refused other_tokenizer "preprocess the text again with --init-from" "$tandem" finetune \
  --init-from "$tmp/fx/lm" --data "$tmp/other" --seq 64 -n 1 --steps 2
mkdir -p "$tmp/empty"
refused not_a_dataset "tandem preprocess --init-from" "$tandem" finetune --init-from "$tmp/fx/lm" --data "$tmp/empty" --seq 64 -n 1 --steps 2
[ "$fails" -eq 0 ] || { echo "$fails check(s) failed"; exit 1; }
echo "all packed-data checks passed"
