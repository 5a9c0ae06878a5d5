#!/usr/bin/env bash
# `tandem finetune --init-from` a tiny random Mixtral (tests/hf/hf_fixture.py: 2 layers, 4
# experts, top-2, router aux coefficient 0.02) on one worker against transformers: the step-1
# loss equals MixtralForCausalLM(ids, labels, output_router_logits=True).loss on the same batch
# (the LM loss plus 0.02 x the load-balancing loss pooled over the layers) within rel 1e-5, and
# the step's aux_loss equals transformers' aux_loss; the checkpoint after 5 steps, exported with
# `tandem export --to hf` and loaded by transformers as a MixtralForCausalLM, gives Tandem's
# step-6 loss and aux loss. --moe-aux-loss per-layer gives the mean of each layer's loss,
# --moe-aux-loss-coef replaces the config's coefficient, --moe-z-loss-coef adds the router z-loss
# (checked against the router logits transformers returns), --capacity-factor 0.5 drops slots, and
# zero3 on 2 workers gives ddp's losses. The training set is 8 documents and the
# global batch 8, so every step's batch is all of them, in an order neither loss depends on. Bad
# input (router_jitter_noise, num_experts_per_tok above num_local_experts, MoE flags on a dense
# model, pooled aux under --pp, classify, LoRA) is refused naming the problem.
# usage: hf_mixtral.sh TANDEM SOURCE_DIR
set -uo pipefail
tandem=$1
src=$2
. "$src/tests/e2e/hf_lib.sh"
fortunes_jsonl "$tmp/lm8.jsonl" 8
fails=0
common=(--init-from "$tmp/fx/mixtral" --data "$tmp/lm8.jsonl" --valid-fraction 0 --seq 32 --batch 8 --lr 2e-3
  --warmup-steps 0 --no-eval --threads 1 --no-progress -n 1)
run() {  # run NAME ARGS...: a finetune run, its metrics in $tmp/NAME.jsonl
  local name=$1; shift
  if ! timeout 300 "$tandem" finetune "${common[@]}" "$@" --metrics "$tmp/$name.jsonl" >"$tmp/$name.log" 2>&1; then
    echo "FAIL $name: exit non-zero; output:"; tail -20 "$tmp/$name.log"; fails=$((fails + 1)); return 1
  fi
}
if run pooled --steps 6 --checkpoint-dir "$tmp/ck" --checkpoint-every 5 &&
  timeout 120 "$tandem" export --to hf "$tmp/export" --checkpoint "$tmp/ck/step-00000005" >"$tmp/export.log" 2>&1; then
  run per_layer --steps 1 --moe-aux-loss per-layer
  run coef --steps 1 --moe-aux-loss-coef 0.5
  run z --steps 1 --moe-z-loss-coef 0.01
  run capacity --steps 1 --capacity-factor 0.5
  common[-1]=2  # -n 2: the same 6 steps on 2 workers under ddp and zero3 (per-layer units)
  run ddp2 --steps 6 && run zero3 --steps 6 --strategy zero3
  grep -q "token slots per expert of 4 .* 0 of 6144 dropped" "$tmp/pooled.log" ||
    { echo "FAIL the report names no experts:"; tail -30 "$tmp/pooled.log"; fails=$((fails + 1)); }
  "$py" - "$tmp" "$src/tests/e2e" <<'PY' || fails=$((fails + 1))
import json, sys, torch
sys.path.insert(0, sys.argv[2])
from hf_batch import lm_batch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
tmp = sys.argv[1]
def steps(name):
    return [d for d in map(json.loads, open(f"{tmp}/{name}.jsonl")) if "step" in d and not d.get("report")]
tok = AutoTokenizer.from_pretrained(f"{tmp}/fx/mixtral")
# Padded with EOS, as Tandem pads for a tokenizer without a pad token: the padding's routing
# counts in the load-balancing loss, as transformers' without an attention mask.
ids, labels = lm_batch(tok, f"{tmp}/lm8.jsonl", 32, tok.eos_token_id)
def losses(path, coef=None):
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if coef is not None:
        m.router_aux_loss_coef = coef
    with torch.no_grad():
        out = m(ids, labels=labels, output_router_logits=True)
    per_layer = sum(load_balancing_loss_func((g,), 4, 2) for g in out.router_logits) / len(out.router_logits)
    # ST-MoE's router z-loss: each layer's mean over tokens of logsumexp(logits)^2, averaged.
    zl = sum(torch.logsumexp(g.float(), -1).pow(2).mean() for g in out.router_logits) / len(out.router_logits)
    return type(m).__name__, out.loss.item(), out.aux_loss.item(), per_layer.item(), zl.item()
ok = True
def check(what, got, want):
    global ok
    rel = abs(got - want) / abs(want)
    good = rel <= 1e-5
    ok = ok and good
    print(f"{'ok  ' if good else 'FAIL'} {what}: Tandem {got:.6f}, transformers {want:.6f} (relative {rel:.1e})")
pooled, per_layer, coef, z, ddp2, zero3 = map(steps, ("pooled", "per_layer", "coef", "z", "ddp2", "zero3"))
if [len(x) for x in (pooled, per_layer, coef, z, ddp2, zero3)] != [6, 1, 1, 1, 6, 6]:
    sys.exit(f"FAIL steps: {[len(x) for x in (pooled, per_layer, coef, z, ddp2, zero3)]}")
for step, path in ((1, f"{tmp}/fx/mixtral"), (6, f"{tmp}/export")):
    cls, loss, aux, layers, zl = losses(path)
    if cls != "MixtralForCausalLM":
        ok = False
        print("FAIL", path, "loads as", cls)
    check(f"step {step} loss", pooled[step - 1]["loss"], loss)
    check(f"step {step} aux loss", pooled[step - 1]["aux_loss"], aux)
    if step == 1:
        check("step 1 per-layer aux loss", per_layer[0]["aux_loss"], layers)
        check("step 1 loss with --moe-aux-loss-coef 0.5", coef[0]["loss"], losses(path, 0.5)[1])
        check("step 1 z-loss", z[0]["z_loss"], zl)
        check("step 1 loss with --moe-z-loss-coef 0.01", z[0]["loss"], loss + 0.01 * zl)
        if abs(aux - layers) < 1e-3 * aux:
            ok = False
            print("FAIL pooled and per-layer aux losses too close to tell apart:", aux, layers)
config = json.load(open(f"{tmp}/export/config.json"))
if config.get("model_type") != "mixtral" or config.get("num_local_experts") != 4 or config.get("num_experts_per_tok") != 2:
    ok = False
    print("FAIL exported config:", config)
report = [d for d in map(json.loads, open(f"{tmp}/pooled.jsonl")) if d.get("report")][0]
moe = report.get("moe", {})
if moe.get("routed", 0) != 6 * 8 * 32 * 2 * 2 or moe.get("dropped") != 0:
    ok = False
    print("FAIL routed/dropped slots in the report:", moe)
dropped = [d for d in map(json.loads, open(f"{tmp}/capacity.jsonl")) if d.get("report")][0].get("moe", {}).get("dropped", 0)
if not 0 < dropped < 1024:
    ok = False
    print(f"FAIL --capacity-factor 0.5 dropped {dropped} of 1024 token slots")
worst = max(max(abs(a["loss"] - b["loss"]), abs(a["aux_loss"] - b["aux_loss"])) for a, b in zip(ddp2, zero3))
print(f"{'ok  ' if worst <= 1e-6 else 'FAIL'} zero3 on 2 workers vs ddp: max |loss or aux difference| {worst:.2g}")
ok = ok and worst <= 1e-6
sys.exit(0 if ok else 1)
PY
else
  echo "FAIL pooled run or its export:"; tail -20 "$tmp/pooled.log" "$tmp/export.log"; fails=$((fails + 1))
fi

# Bad input, refused before any worker starts.
bad_config() {  # bad_config NAME KEY VALUE: the fixture with config.json's KEY set to VALUE
  cp -r "$tmp/fx/mixtral" "$tmp/$1"
  "$py" - "$tmp/$1/config.json" "$2" "$3" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c[sys.argv[2]] = json.loads(sys.argv[3])
json.dump(c, open(sys.argv[1], "w"))
PY
}
bad_config jitter router_jitter_noise 0.1
bad_config topk num_experts_per_tok 5
bad_config window sliding_window 16
data=(--data "$tmp/lm8.jsonl" --steps 1 --no-progress)
refused jitter '"router_jitter_noise" is 0.1' "$tandem" finetune --init-from "$tmp/jitter" "${data[@]}" -n 1
refused topk '"num_experts_per_tok" is 5' "$tandem" finetune --init-from "$tmp/topk" "${data[@]}" -n 1
refused window '"sliding_window" is 16' "$tandem" finetune --init-from "$tmp/window" "${data[@]}" -n 1
refused dense_flags 'is dense' "$tandem" finetune --init-from "$tmp/fx/lm" "${data[@]}" --moe-aux-loss-coef 0.1
refused pp_pooled 'use --moe-aux-loss per-layer' "$tandem" finetune --init-from "$tmp/fx/mixtral" "${data[@]}" -n 2 --pp 2
refused classify 'use --task lm' "$tandem" finetune --init-from "$tmp/fx/mixtral" "${data[@]}" --task classify
refused lora 'LoRA' "$tandem" finetune --init-from "$tmp/fx/mixtral" "${data[@]}" --lora-rank 4
refused aux_form "--moe-aux-loss: unknown load-balancing loss form 'mean'" "$tandem" finetune --init-from "$tmp/fx/mixtral" "${data[@]}" --moe-aux-loss mean
refused capacity '--capacity-factor must be >= 0' "$tandem" finetune --init-from "$tmp/fx/mixtral" "${data[@]}" --capacity-factor -1
[ $fails -eq 0 ] && echo "all passed" || echo "$fails failed"
exit $((fails > 0))
