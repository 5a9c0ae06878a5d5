#!/usr/bin/env bash
# `tandem pretrain --data DIR` on a `tandem preprocess` output (Tandem's own transformer on packed
# windows read by mmap, the vocabulary of the dataset's SentencePiece tokenizer): what every rank
# trained on (--data-record) is the .bin's packed windows with Megatron's reset positions
# (tests/e2e/packed_reference.py, numpy); a run stopped at a checkpoint on 2 workers and resumed on
# 1 trains every sample once and the same windows as an uninterrupted run; zero3 and tp2 follow
# one worker's losses within 1e-6; the checkpoint's tokenizer.model is the dataset's and tandem
# finetune classifies from it. Refused: --pp 2, --cp 2, --vocab, --tokenizer-sentences.
# usage: pretrain_packed.sh TANDEM SOURCE_DIR
set -uo pipefail
tandem=$1
src=$2
. "$src/tests/e2e/hf_lib.sh"
fails=0
# prun NAME ARGS...: one `tandem pretrain` run, its metrics in $tmp/NAME.jsonl.
prun() {
  local name=$1; shift
  if ! timeout 120 "$tandem" pretrain "$@" --metrics "$tmp/$name.jsonl" --no-progress --threads 1 \
    >"$tmp/$name.log" 2>&1; then
    echo "FAIL $name: exit non-zero; output:"; tail -20 "$tmp/$name.log"; fails=$((fails + 1)); return 1
  fi
  echo "ran  $name"
}
# equal REF NAME: NAME's losses equal REF's within 1e-6 at every step.
equal() {
  "$py" - "$src/tests/e2e" "$tmp/$1.jsonl" "$tmp/$2.jsonl" <<'PY' || fails=$((fails + 1))
import sys
sys.path.insert(0, sys.argv[1])
import metrics
ref, _ = metrics.load(sys.argv[2])
got, _ = metrics.load(sys.argv[3])
diff = max(abs(a - b) for a, b in zip(ref, got)) if len(got) == len(ref) > 0 else float("inf")
ok = diff <= 1e-6 and ref[0] - ref[-1] > 0.05
name = sys.argv[3].rsplit("/", 1)[1]
print(f"{'ok  ' if ok else 'FAIL'} {name}: {len(got)} steps, max |loss - one worker's| {diff:.2g}"
      f" (one worker: {ref[0]:.4f} -> {ref[-1]:.4f})")
sys.exit(0 if ok else 1)
PY
}

fortunes_jsonl "$tmp/c.jsonl" 60
ref=("$py" "$src/tests/e2e/packed_reference.py")
if ! timeout 120 "$tandem" preprocess --init-from "$tmp/fx/lm" --data "$tmp/c.jsonl" --out "$tmp/d" --threads 2 \
  >"$tmp/pre.log" 2>&1; then
  echo "FAIL preprocess:"; tail -5 "$tmp/pre.log"; exit 1
fi
pk=(--data "$tmp/d" --seq 64 --batch 8 --d-model 32 --heads 4 --layers 2 --lr 3e-3 --warmup-steps 2)
# The data order: one uninterrupted run, and 2 workers -> (stop at step 6) 1 worker -> step 14.
prun whole -n 1 --strategy single "${pk[@]}" --steps 14 --out "$tmp/whole" --data-record "$tmp/rec_whole"
prun part1 -n 2 "${pk[@]}" --steps 6 --out "$tmp/p1" --checkpoint-dir "$tmp/ck" --checkpoint-every 3 \
  --data-record "$tmp/rec1"
prun part2 -n 1 "${pk[@]}" --steps 14 --out "$tmp/p2" --checkpoint-dir "$tmp/ck" --resume --data-record "$tmp/rec2"
grep -h resuming "$tmp/part2.log"
"${ref[@]}" record "$tmp/d" 64 8 "$tmp/rec1@0" "$tmp/rec2@6" --ref "$tmp/rec_whole" 2>/dev/null ||
  fails=$((fails + 1))
"$py" - "$tmp/ck/step-00000006/manifest.json" <<'PY' || fails=$((fails + 1))
import json, sys
d = json.load(open(sys.argv[1]))["extra"]["data"]
n = d["samples_per_epoch"]
ok = d == {"epoch": 48 // n, "index": 48 % n, "samples_per_epoch": n}
print(f"{'ok  ' if ok else 'FAIL'} the step-6 checkpoint records the data loader at {d}")
sys.exit(0 if ok else 1)
PY
if cmp -s "$tmp/fx/lm/tokenizer.model" "$tmp/whole/tokenizer.model"; then
  echo "ok   the checkpoint's tokenizer.model is the dataset's"
else
  echo "FAIL the checkpoint's tokenizer.model is not the dataset's"; fails=$((fails + 1))
fi
if timeout 120 "$tandem" finetune --checkpoint "$tmp/whole" --steps 2 --batch 8 --max-per-label 20 -n 1 \
  --no-progress --threads 1 >"$tmp/ft.log" 2>&1 && grep -q "test accuracy" "$tmp/ft.log"; then
  echo "ok   finetune --checkpoint classifies from the packed pretrain"
else
  echo "FAIL finetune --checkpoint:"; tail -5 "$tmp/ft.log"; fails=$((fails + 1))
fi

# Layouts: the same packed batches, the same losses.
prun single -n 1 --strategy single "${pk[@]}" --steps 10 --out "$tmp/o1"
prun zero3 -n 2 --strategy zero3 "${pk[@]}" --steps 10 --out "$tmp/o2" && equal single zero3
prun tp2 -n 2 --tp 2 "${pk[@]}" --steps 10 --out "$tmp/o3" && equal single tp2

# Bad combinations.
refused pp2 "--pp 2" "$tandem" pretrain "${pk[@]}" --out "$tmp/x" -n 2 --pp 2 --steps 2 --no-progress
refused cp2 "--cp 2" "$tandem" pretrain "${pk[@]}" --out "$tmp/x" -n 2 --cp 2 --steps 2 --no-progress
refused vocab "--vocab does not apply" "$tandem" pretrain "${pk[@]}" --out "$tmp/x" --vocab 500 --steps 2
refused sentences "--tokenizer-sentences does not apply" "$tandem" pretrain "${pk[@]}" --out "$tmp/x" \
  --tokenizer-sentences 10 --steps 2
refused bf16-seq "--precision bf16 takes --seq 257 at most" "$tandem" pretrain --data "$tmp/d" --seq 320 --batch 8 \
  --d-model 32 --heads 4 --layers 2 --precision bf16 --out "$tmp/x" --steps 2 --no-progress
refused record "--data-record needs a preprocessed --data" "$tandem" pretrain --out "$tmp/x" --steps 2 \
  --data-record "$tmp/r"
[ "$fails" -eq 0 ] || { echo "$fails check(s) failed"; exit 1; }
echo "all packed pretrain checks passed"
