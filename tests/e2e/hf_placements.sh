#!/usr/bin/env bash
# `tandem finetune --init-from HF_DIR` under tp2 x zero3 (also with --sequence-parallel),
# pp2 x zero2 and tp2 x cp2 (context parallel: each sequence split over 2 ranks, ring attention)
# on 4 workers against transformers on a tiny random Llama: every rank initialises only the
# pieces it holds, and the step-1 loss equals transformers' loss on the same batch
# (rel <= 1e-5); the checkpoint after 5 steps, exported with `tandem export --to hf` and loaded
# by transformers, gives Tandem's step-6 loss (rel <= 1e-5). The training set is 8 documents
# and the global batch 8, so every step's batch is all of them and its loss (per token) does not
# depend on their order.
# usage: hf_placements.sh TANDEM SOURCE_DIR
set -uo pipefail
tandem=$1
src=$2
. "$src/tests/e2e/hf_lib.sh"
fortunes_jsonl "$tmp/lm8.jsonl" 8
fails=0
for layout in "tp2_zero3:--tp 2 --strategy zero3" "tp2_sp_zero3:--tp 2 --sequence-parallel --strategy zero3" \
  "pp2_zero2:--pp 2 --micro-batches 2 --strategy zero2" "tp2_cp2:--tp 2 --cp 2 --strategy zero1"; do
  name=${layout%%:*}
  read -r -a args <<<"${layout#*:}"
  if ! timeout 300 "$tandem" finetune -n 4 "${args[@]}" --init-from "$tmp/fx/lm" --data "$tmp/lm8.jsonl" \
      --valid-fraction 0 --seq 32 --batch 8 --steps 6 --lr 2e-3 --warmup-steps 0 --no-eval --threads 1 \
      --no-progress --checkpoint-dir "$tmp/ck_$name" --checkpoint-every 5 --metrics "$tmp/$name.jsonl" \
      >"$tmp/$name.log" 2>&1; then
    echo "FAIL $name: exit non-zero; output:"; tail -20 "$tmp/$name.log"; fails=$((fails + 1)); continue
  fi
  if ! timeout 120 "$tandem" export --to hf "$tmp/export_$name" --checkpoint "$tmp/ck_$name/step-00000005" \
      >"$tmp/export_$name.log" 2>&1; then
    echo "FAIL $name: export failed:"; tail -20 "$tmp/export_$name.log"; fails=$((fails + 1)); continue
  fi
  "$py" - "$src/tests/e2e" "$tmp" "$name" <<'PY' || fails=$((fails + 1))
import sys, torch
sys.path.insert(0, sys.argv[1])
import metrics
from hf_batch import lm_batch
from transformers import AutoModelForCausalLM, AutoTokenizer
tmp, name = sys.argv[2], sys.argv[3]
losses, _ = metrics.load(f"{tmp}/{name}.jsonl")
tok = AutoTokenizer.from_pretrained(f"{tmp}/fx/lm")
ids, labels = lm_batch(tok, f"{tmp}/lm8.jsonl", 32, 0)  # padding ignored by the loss
def loss_of(path):
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(ids, labels=labels).loss.item()
ok = len(losses) == 6
for step, path in ((1, f"{tmp}/fx/lm"), (6, f"{tmp}/export_{name}")):
    want, got = loss_of(path), losses[step - 1] if ok else float("nan")
    rel = abs(got - want) / abs(want)
    good = rel <= 1e-5
    ok = ok and good
    print(f"{'ok  ' if good else 'FAIL'} {name}: step {step} loss {got:.6f}, transformers' {want:.6f} (relative {rel:.1e})")
sys.exit(0 if ok else 1)
PY
done
[ $fails -eq 0 ] && echo "all passed" || echo "$fails failed"
exit $((fails > 0))
