#!/usr/bin/env bash
# `tandem finetune --init-from HF_DIR` on a tiny random Llama that transformers made
# (tests/hf/hf_fixture.py): 20 steps of language modelling on fortune cookies under ddp, zero2,
# zero3, a 2-stage pipeline and tp2 on 2 workers, dp2 x tp2 (ddp, zero3) and tp2 x pp2 on 4
# (tp2, tp2 x pp2, tied tp2 and the classifier's tp2 again with --sequence-parallel give the same
# layouts' losses without it), and a model
# cut 3 ways, dp2 x tp3 under zero3 and zero2 on 6, give one worker's per-step losses within 1e-4, and so does a model with tied embeddings under zero2, zero3 and tp2; bf16 and
# fp16 (ddp) and bf16 under tp2 follow its losses within 5e-3 relative; classification under
# ddp, tp2, pp2 and tp2 x pp2 gives one worker's too; runs resumed under zero2 and tp2 from the pipeline's step-10
# checkpoint, and on one worker from tp2's, continue one worker's losses;
# `tandem export --to hf` of the pipeline's, tp2's and the tied model's (zero2, tp2) checkpoints
# loads in transformers. Fails without .venv-hf or the fortunes corpus.
# usage: hf_finetune.sh TANDEM SOURCE_DIR
set -uo pipefail
tandem=$1
src=$2
. "$src/tests/e2e/hf_lib.sh"
# Fortune cookies as {"text"}, and as {"text", "label"} with the classifier's label names.
fortunes_jsonl "$tmp/lm.jsonl" 300
classify_jsonl "$tmp/lm.jsonl" "$tmp/cls.jsonl"
fails=0
lm=(--init-from "$tmp/fx/lm" --data "$tmp/lm.jsonl" --seq 32 --batch 8 --steps 20 --lr 2e-3 --warmup-steps 2 --no-eval)
run single -n 1 --strategy single "${lm[@]}"
run ddp -n 2 --strategy ddp "${lm[@]}" && same single ddp
run zero2 -n 2 --strategy zero2 "${lm[@]}" && same single zero2
# zero3: each rank initialises only its flat shard from the files (EngineOptions::init_from).
run zero3 -n 2 --strategy zero3 "${lm[@]}" && same single zero3
run pp2 -n 2 --strategy ddp --pp 2 --micro-batches 2 --checkpoint-dir "$tmp/ck" --checkpoint-every 10 "${lm[@]}" &&
  same single pp2
# zb-v: the decoder layers' projections defer their weight gradients to W passes; the loss is on rank 0.
run pp2_zbv -n 2 --strategy ddp --pp 2 --micro-batches 2 --pipeline-schedule zb-v "${lm[@]}" && same single pp2_zbv
resume() {  # resume CK NAME ARGS...: CK's step-10 checkpoint resumed under ARGS gives one worker's steps 11-20
  local ck=$tmp/$1 name=$2 newest
  shift 2
  newest=$(ls -d "$ck"/step-*20* 2>/dev/null | head -1)
  if [ -z "$newest" ]; then
    echo "FAIL no step-20 checkpoint in $ck: $(ls "$ck")"; fails=$((fails + 1)); return 1
  fi
  mv "$newest" "$tmp/step20-aside"
  run "$name" "$@" --checkpoint-dir "$ck" --resume "${lm[@]}" && same single "$name" 11
  rm -rf "$newest" && mv "$tmp/step20-aside" "$newest"  # the layout's own step 20, for export
}
# The pipeline's step-10 checkpoint resumed under zero2 and under tp2 (its whole values cut).
resume ck resumed -n 2 --strategy zero2
resume ck resumed_tp2 -n 2 --strategy ddp --tp 2
# Tensor parallelism (the vocabulary-parallel head and loss), alone and with data parallelism or
# a pipeline; tp2's step-10 checkpoint (gathered whole) resumed on one worker.
run tp2 -n 2 --strategy ddp --tp 2 --checkpoint-dir "$tmp/ck_tp" --checkpoint-every 10 "${lm[@]}" && same single tp2
resume ck_tp resumed_from_tp2 -n 1 --strategy single
run dp2tp2 -n 4 --strategy ddp --tp 2 "${lm[@]}" && same single dp2tp2
run tp2pp2 -n 4 --strategy ddp --tp 2 --pp 2 --micro-batches 2 "${lm[@]}" && same single tp2pp2
# Sequence parallelism (norms and residual on sequence shards, all-gathers and reduce-scatters
# instead of all-reduces) reproduces tp2's and tp2 x pp2's losses.
run tp2_sp -n 2 --strategy ddp --tp 2 --sequence-parallel "${lm[@]}" && same tp2 tp2_sp
# The report's traffic line: all-gathers and reduce-scatters in place of tp2's all-reduces.
"$py" - "$tmp/tp2.log" "$tmp/tp2_sp.log" <<'PY' || fails=$((fails + 1))
import re, sys
def ops(path):
    line = [l for l in open(path) if l.startswith("traffic per step")][0]
    return {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+) MiB", line.split("payload:")[1])}
tp, sp = ops(sys.argv[1]), ops(sys.argv[2])
ok = sp.get("allgather", 0) > 0 and sp.get("reduce_scatter", 0) > 0 and sp.get("allreduce", 0) < tp.get("allreduce", 0) / 4
print(f"{'ok  ' if ok else 'FAIL'} tp2_sp traffic per step (MiB): {sp}; tp2: {tp}")
sys.exit(0 if ok else 1)
PY
run tp2pp2_sp -n 4 --strategy ddp --tp 2 --pp 2 --micro-batches 2 --sequence-parallel "${lm[@]}" &&
  same tp2pp2 tp2pp2_sp
# ZeRO-3 over tp2's replicas: each rank reads only its shard of its tensor-parallel block.
run dp2tp2_zero3 -n 4 --strategy zero3 --tp 2 "${lm[@]}" && same single dp2tp2_zero3
# Three tensor-parallel ranks (a model whose heads, KV heads, MLP width and vocabulary divide by
# 3; one KV head per rank) with ZeRO-3 and ZeRO-2 over 2 replicas.
tp3=(--init-from "$tmp/fx/lm_tp3" --data "$tmp/lm.jsonl" --seq 32 --batch 12 --steps 20 --lr 2e-3 --warmup-steps 2 --no-eval)
run tp3_single -n 1 --strategy single "${tp3[@]}"
run dp2tp3_zero3 -n 6 --strategy zero3 --tp 3 "${tp3[@]}" && same tp3_single dp2tp3_zero3
run dp2tp3_zero2 -n 6 --strategy zero2 --tp 3 "${tp3[@]}" && same tp3_single dp2tp3_zero2
# bf16 and fp16 compute (fp32 master weights, fp16 with loss scaling) on 2 workers, under ddp and
# tp2, follow the fp32 worker's losses. Tolerance: bf16 keeps 8 significant bits (a rounding is
# off by up to 2^-9 = 0.2%), fp16 11; the losses are means over ~200 tokens, whose rounding
# errors mostly cancel (measured: 5e-4 relative for bf16, 5e-5 for fp16, over 20 steps). 5e-3
# relative is 10 times bf16's and still below a loss's change per step (~1%).
run bf16 -n 2 --strategy ddp --precision bf16 "${lm[@]}" && near single bf16 5e-3
run fp16 -n 2 --strategy ddp --precision fp16 "${lm[@]}" && near single fp16 5e-3
run tp2_bf16 -n 2 --strategy ddp --tp 2 --precision bf16 "${lm[@]}" && near single tp2_bf16 5e-3
# Tied embeddings: transformers' module tree instead of the Sequential, under zero2.
tied=(--init-from "$tmp/fx/lm_tied" --data "$tmp/lm.jsonl" --seq 32 --batch 8 --steps 20 --lr 2e-3 --warmup-steps 2 --no-eval)
run tied_single -n 1 --strategy single "${tied[@]}"
run tied_zero2 -n 2 --strategy zero2 --checkpoint-dir "$tmp/ck_tied" "${tied[@]}" && same tied_single tied_zero2
run tied_zero3 -n 2 --strategy zero3 "${tied[@]}" && same tied_single tied_zero3
# Tied under tp2: the head over the vocabulary-parallel embedding's shard.
run tied_tp2 -n 2 --strategy ddp --tp 2 --checkpoint-dir "$tmp/ck_tied_tp" "${tied[@]}" && same tied_single tied_tp2
run tied_tp2_sp -n 2 --strategy ddp --tp 2 --sequence-parallel "${tied[@]}" && same tied_tp2 tied_tp2_sp
cls=(--init-from "$tmp/fx/cls" --task classify --data "$tmp/cls.jsonl" --seq 32 --batch 8 --steps 20 --lr 2e-3 --warmup-steps 2)
run cls_single -n 1 --strategy single "${cls[@]}"
run cls_ddp -n 2 --strategy ddp "${cls[@]}" && same cls_single cls_ddp 1 -1e9
grep -q "accuracy" "$tmp/cls_ddp.log" || { echo "FAIL cls_ddp: no validation accuracy"; fails=$((fails + 1)); }
# The classifier cut: its score head replicated over tp2's ranks, on the last stage of pp2 (which
# pools each row's last real token from the targets), and both at once on 4; all score the
# validation split.
run cls_tp2 -n 2 --strategy ddp --tp 2 "${cls[@]}" && same cls_single cls_tp2 1 -1e9
run cls_tp2_sp -n 2 --strategy ddp --tp 2 --sequence-parallel "${cls[@]}" && same cls_tp2 cls_tp2_sp 1 -1e9
run cls_pp2 -n 2 --strategy ddp --pp 2 --micro-batches 2 "${cls[@]}" && same cls_single cls_pp2 1 -1e9
run cls_tp2pp2 -n 4 --strategy ddp --tp 2 --pp 2 --micro-batches 2 "${cls[@]}" && same cls_single cls_tp2pp2 1 -1e9
for name in cls_tp2 cls_tp2_sp cls_pp2 cls_tp2pp2; do
  grep -q "accuracy" "$tmp/$name.log" || { echo "FAIL $name: no validation accuracy"; fails=$((fails + 1)); }
done
# The pipeline's and the tied model's last checkpoints as Hugging Face directories, loaded by
# transformers.
for ck in ck ck_tp ck_tied ck_tied_tp; do
if timeout 120 "$tandem" export --to hf "$tmp/export_$ck" --checkpoint "$tmp/$ck" >"$tmp/export.log" 2>&1 &&
  "$py" - "$tmp/export_$ck" <<'PY'
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
m = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
t = AutoTokenizer.from_pretrained(sys.argv[1])
ids = t("You will be married within a year.", return_tensors="pt")["input_ids"]
with torch.no_grad():
    print("ok   export", sys.argv[1].rsplit("/", 1)[1], "loads in transformers; loss on a sentence",
          round(m(ids, labels=ids).loss.item(), 4), "tied" if m.config.tie_word_embeddings else "untied")
PY
then :; else
  echo "FAIL export of $ck:"; tail -20 "$tmp/export.log"; fails=$((fails + 1))
fi
done
[ $fails -eq 0 ] && echo "all passed" || echo "$fails failed"
exit $((fails > 0))
