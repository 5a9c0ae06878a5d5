#!/usr/bin/env bash
# `tandem finetune --init-from` the tiny random Mixtral (tests/hf/hf_fixture.py: 2 layers, 4
# experts, top-2) under expert parallelism, against one worker running the same micro-batches
# (--grad-accum: the load-balancing loss is per forward, as transformers computes it, so a
# replica's rows are its own micro-batch): ep 2, ep 2 x zero3 with every layer recomputed and
# tensor-parallel experts (tp 2) on 2 workers, ep 2 x dp 2, ep 2 x pp 2 (per-layer loss) and
# tp 2 x ep 2 with sequence parallelism on 4, 5 steps each, losses and aux losses within rel
# 1e-5. The
# ep 2 checkpoint after 5 steps, exported with `tandem export --to hf`, loads in transformers as
# a MixtralForCausalLM and gives Tandem's step-6 language-model loss (rel 1e-5). The report
# names the experts' routing and the all-to-all. --ep that does not divide the experts (or the
# workers) is refused naming both numbers.
# usage: hf_mixtral_ep.sh TANDEM SOURCE_DIR
set -uo pipefail
tandem=$1
src=$2
. "$src/tests/e2e/hf_lib.sh"
fortunes_jsonl "$tmp/lm8.jsonl" 8
fails=0
common=(--init-from "$tmp/fx/mixtral" --data "$tmp/lm8.jsonl" --valid-fraction 0 --seq 32 --batch 8 --lr 2e-3
  --warmup-steps 0 --no-eval --threads 1 --no-progress)
run() {  # run NAME ARGS...: a finetune run, its metrics in $tmp/NAME.jsonl
  local name=$1; shift
  if ! timeout 300 "$tandem" finetune "${common[@]}" "$@" --metrics "$tmp/$name.jsonl" >"$tmp/$name.log" 2>&1; then
    echo "FAIL $name: exit non-zero; output:"; tail -20 "$tmp/$name.log"; fails=$((fails + 1)); return 1
  fi
}
run one2 -n 1 --steps 6 --grad-accum 2  # 6 steps: the learning-rate schedule of ep2, tp2 and tp2_ep2
run one4 -n 1 --steps 5 --grad-accum 4
run one4_layer -n 1 --steps 5 --grad-accum 4 --moe-aux-loss per-layer
run ep2 -n 2 --ep 2 --steps 6 --checkpoint-dir "$tmp/ck" --checkpoint-every 5 &&
  { timeout 120 "$tandem" export --to hf "$tmp/export" --checkpoint "$tmp/ck/step-00000005" >"$tmp/export.log" 2>&1 ||
    { echo "FAIL export:"; tail -20 "$tmp/export.log"; fails=$((fails + 1)); }; }
run ep2_zero3 -n 2 --ep 2 --strategy zero3 --activation-checkpointing every --steps 6
run ep2_dp2 -n 4 --ep 2 --steps 5
run ep2_pp2 -n 4 --ep 2 --pp 2 --micro-batches 2 --moe-aux-loss per-layer --steps 5
run tp2 -n 2 --tp 2 --grad-accum 2 --steps 6
run tp2_ep2 -n 4 --tp 2 --ep 2 --sequence-parallel --steps 6
for want in "routing .* token slots per expert of 4 .*experts over --ep 2" "all-to-all .* dispatching and combining"; do
  grep -q "$want" "$tmp/ep2.log" || { echo "FAIL the ep2 report has no line like '$want':"; tail -30 "$tmp/ep2.log"; fails=$((fails + 1)); }
done
"$py" - "$tmp" "$src/tests/e2e" <<'PY' || fails=$((fails + 1))
import json, sys, torch
sys.path.insert(0, sys.argv[2])
from hf_batch import lm_batch
from transformers import AutoModelForCausalLM, AutoTokenizer
tmp = sys.argv[1]
def steps(name):
    return [d for d in map(json.loads, open(f"{tmp}/{name}.jsonl")) if "step" in d and not d.get("report")]
ok = True
for name, ref in (("ep2", "one2"), ("ep2_zero3", "one2"), ("ep2_dp2", "one4"), ("ep2_pp2", "one4_layer"),
                  ("tp2", "one2"), ("tp2_ep2", "one2")):
    got, want = steps(name)[:5], steps(ref)[:5]
    if len(got) != 5 or len(want) != 5:
        print(f"FAIL {name}: {len(got)} steps against {len(want)}"); ok = False; continue
    worst = max(max(abs(a["loss"] - b["loss"]) / abs(b["loss"]), abs(a["aux_loss"] - b["aux_loss"]) / abs(b["aux_loss"]))
                for a, b in zip(got, want))
    good = worst <= 1e-5
    ok = ok and good
    print(f"{'ok  ' if good else 'FAIL'} {name} vs one worker ({ref}): 5 losses and aux losses, max relative difference {worst:.1e}")
tok = AutoTokenizer.from_pretrained(f"{tmp}/fx/mixtral")
ids, labels = lm_batch(tok, f"{tmp}/lm8.jsonl", 32, tok.eos_token_id)
m = AutoModelForCausalLM.from_pretrained(f"{tmp}/export", dtype=torch.float32).eval()
with torch.no_grad():
    lm = m(ids, labels=labels).loss.item()
report = [d for d in map(json.loads, open(f"{tmp}/ep2.jsonl")) if d.get("report")][0]
s6 = steps("ep2")[5]
tandem_lm = s6["loss"] - report["moe"]["aux_loss_coef"] * s6["aux_loss"]
rel = abs(tandem_lm - lm) / abs(lm)
good = type(m).__name__ == "MixtralForCausalLM" and rel <= 1e-5
ok = ok and good
print(f"{'ok  ' if good else 'FAIL'} export of ep 2 as {type(m).__name__}: step-6 LM loss Tandem {tandem_lm:.6f}, transformers {lm:.6f} (relative {rel:.1e})")
moe = report.get("moe", {})
if moe.get("experts") != 4 or not 0 < moe.get("tokens_per_expert_min", 0) <= moe.get("tokens_per_expert_max", 0) or not moe.get("all_to_all_bytes_per_step", 0) > 0:
    ok = False
    print("FAIL the ep2 report's MoE figures:", moe)
sys.exit(0 if ok else 1)
PY
data=(--data "$tmp/lm8.jsonl" --steps 1 --no-progress)
cp -r "$tmp/fx/mixtral" "$tmp/six"
"$py" - "$tmp/six" <<'PY'
import json, sys
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1])
m.config.num_local_experts = 6
AutoModelForCausalLM.from_config(m.config).save_pretrained(sys.argv[1])
PY
refused not_divisible "num_local_experts 6 is not divisible by --ep 4" "$tandem" finetune "${data[@]}" --init-from "$tmp/six" -n 4 --ep 4
refused workers "--ep 3 does not divide the 2 data-parallel ranks" "$tandem" finetune "${data[@]}" --init-from "$tmp/fx/mixtral" -n 2 --ep 3
[ $fails -eq 0 ] && echo "all passed" || echo "$fails failed"
exit $((fails > 0))
