#!/usr/bin/env bash
# `tandem plan` on mixture-of-experts models: Mixtral 8x7B (the preset, and its config.json) with
# expert parallelism fixed and searched, the table's ep and all-to-all columns, and JSON whose expert memory and all-to-all
# figures obey the model's rules (ep and tp divide the experts' state, all-to-alls only with ep > 1,
# ep x tp layouts searched).
# usage: plan_moe.sh TANDEM
set -euo pipefail
tandem=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
"$tandem" plan --model mixtral-8x7b --cluster h100-ib --batch 64 --ep 8 --top 3 | tee fixed.txt
grep -qE '^experts +8 of width 14336 in 32 MoE blocks, top 2, dropless' fixed.txt || { echo "no experts line"; exit 1; }
grep -qE '^rank +layout +ep .*a2a ms' fixed.txt || { echo "no ep / a2a columns"; exit 1; }
grep -qE '^1 +dp[0-9]+ ep8 tp[0-9]+ pp[0-9]+.* +8 +' fixed.txt || { echo "rank 1 is not an ep 8 layout"; exit 1; }
grep -qE '^a2a ms: the MoE layers. all-to-alls' fixed.txt || { echo "no all-to-all note"; exit 1; }
grep -qE '\(experts [0-9.]+ [GMk]B / [0-9.]+ [GMk]B\)' fixed.txt || { echo "no expert memory"; exit 1; }
# A Hugging Face checkpoint's config.json (Mixtral 8x7B's fields) plans as the preset does.
mkdir hf
cat >hf/config.json <<'JSON'
{"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
 "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
 "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 32768,
 "tie_word_embeddings": false}
JSON
"$tandem" plan --model hf --cluster h100-ib --batch 64 --ep 8 --top 3 >hf.txt
diff <(sed 1d fixed.txt) <(sed 1d hf.txt) || { echo "config.json plans otherwise than the preset"; exit 1; }
"$tandem" plan --model mixtral-8x7b --cluster h100-ib --batch 64 --top 100 --json search.json >/dev/null
"$tandem" plan --model moe_tiny --cluster h100x8 --batch 64 --zero 0 --top 100 --json tiny.json >/dev/null
python3 - search.json tiny.json <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
assert j["model"]["moe"]["experts"] == 8 and j["model"]["moe"]["top_k"] == 2, j["model"]
lay = j["layouts"]
assert {l["ep"] for l in lay} == {1, 2, 4, 8}, sorted({l["ep"] for l in lay})
assert any(l["ep"] > 1 and l["tp"] > 1 for l in lay), "no ep x tp layout searched"
for l in lay:
    assert l["dp"] % l["ep"] == 0 and 8 % l["ep"] == 0, l
    if l["tp"] > 1:
        assert 14336 % l["tp"] == 0, l
    if l["feasible"]:
        assert ("all_to_all_seconds" in l) == (l["ep"] > 1), l
        if l["ep"] > 1:
            assert l["all_to_all_bytes"] > 0 and l["comm_parts"]["ep all-to-all"] == l["all_to_all_seconds"], l
            assert l["all_to_all_seconds"] <= l["step_seconds"], l
    ex = l["memory_bytes"]["experts"]
    m = l["memory_bytes"]
    assert 0 < ex["states"] < m["parameters"] + m["gradients"] + m["optimizer"], l
    assert 0 < ex["activations"] < m["activations"], l
# Without ZeRO the experts' state per rank is 1/(ep tp) of ep 1 tp 1's at the same dp and pp.
t = {(l["dp"], l["pp"], l["ep"], l["tp"]): l for l in json.load(open(sys.argv[2]))["layouts"]}
pairs = 0
for (dp, pp, ep, tp), l in t.items():
    if ep * tp > 1 and (dp, pp, 1, 1) in t:
        one = t[(dp, pp, 1, 1)]["memory_bytes"]
        assert abs(l["memory_bytes"]["experts"]["states"] * ep * tp - one["experts"]["states"]) <= 1e-6 * one["experts"]["states"], (l, one)
        pairs += 1
assert pairs >= 3, pairs
print("plan MoE ok:", len(lay), "Mixtral layouts,", pairs, "moe_tiny (ep, tp) / (1, 1) pairs")
PY
