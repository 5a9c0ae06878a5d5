#!/usr/bin/env bash
# `tandem plan` output: a ranked table and JSON whose numbers obey the model's own rules.
# usage: plan_output.sh TANDEM
set -euo pipefail
tandem=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
"$tandem" plan --model gpt2 --cluster h100-ib --top 3 | tee out.txt
grep -qE '^1 +' out.txt
"$tandem" plan --model llama-13b --cluster a100-ib --checkpointing --json plan.json >/dev/null
python3 - plan.json <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
lay = j["layouts"]
feas = [l for l in lay if l["feasible"]]
bad = [l for l in lay if not l["feasible"]]
assert feas, "no feasible layout"
steps = [l["step_seconds"] for l in feas]
assert steps == sorted(steps), "feasible layouts not ranked by step time"
for l in feas:
    assert l["dp"] * l["cp"] * l["tp"] * l["pp"] == j["cluster"]["devices"], l
    assert l["memory_bytes"]["total"] <= 0.9 * 80 * 2**30 + 1, l
    assert 0 < l["efficiency"] <= 1.0 + 1e-9, l
assert all(l.get("why") for l in bad), "an infeasible layout without a reason"
# ZeRO memory ordering for the same dp/tp/pp: stage 3 <= 2 <= 1 <= 0 model states.
by = {}
for l in lay:
    m = l["memory_bytes"]
    by.setdefault((l["dp"], l["tp"], l["pp"]), {})[l["zero"]] = m["parameters"] + m["gradients"] + m["optimizer"]
for k, z in by.items():
    stages = sorted(z)
    vals = [z[s] for s in stages]
    assert vals == sorted(vals, reverse=True), (k, z)
print("plan JSON ok:", len(feas), "feasible,", len(bad), "infeasible")
PY
# A layered model's pipeline names its cut (the default --pp-partition auto keeps the faster of
# the cuts by parameters and by FLOPs), in the table and the JSON; a list is used as given.
"$tandem" plan --model cnn --cluster h100x8 --devices 2 --top 20 --json cnn.json >/dev/null
"$tandem" plan --model cnn --cluster h100x8 --devices 2 --top 20 | tee cnn.txt >/dev/null
grep -qE 'dp1 tp1 pp2 cut [0-9]+/[0-9]+ ' cnn.txt || { echo "the pp2 layout names no cut"; cat cnn.txt; exit 1; }
"$tandem" plan --model cnn --cluster h100x8 --devices 2 --top 20 --pp-partition 5,5 --json cnn55.json >/dev/null
python3 - cnn.json cnn55.json <<'PY'
import json, sys
for path, want in ((sys.argv[1], None), (sys.argv[2], [5, 5])):
    pp = [l for l in json.load(open(path))["layouts"] if l["pp"] == 2 and l["feasible"]]
    assert pp, f"{path}: no feasible pp2 layout"
    for l in pp:
        assert len(l["partition"]) == 2 and sum(l["partition"]) == 10, l
        assert want is None or l["partition"] == want, l
print("plan pipeline cuts ok")
PY
# Context parallelism: --cp 2 prices only cp 2 layouts (a replica of cp x tp x pp devices), the
# table gains its cp and ring columns, and the JSON's activations are half of cp 1's.
"$tandem" plan --model llama-7b --cluster h100x8 --batch 8 --cp 2 --top 3 | tee cp.txt
grep -qE '^rank +layout +cp .*ring ms' cp.txt || { echo "no cp column"; cat cp.txt; exit 1; }
grep -qE '^1 +dp[0-9]+ cp2 tp[0-9]+ pp[0-9]+.* +2 +' cp.txt || { echo "rank 1 is not a cp 2 layout"; cat cp.txt; exit 1; }
# Data parallel only on 2 and 4 workers: dp 2 x cp 1 and dp 2 x cp 2 take the same micro-batches.
"$tandem" plan --model llama-7b --cluster h100x8 --batch 8 --workers 2,4 --cp 1,2 --json cp.json >/dev/null
python3 - cp.json <<'PY'
import json, sys
lay = json.load(open(sys.argv[1]))["layouts"]
assert {l["cp"] for l in lay} == {1, 2}, "--cp 1,2 did not price both"
# Activations per rank do not depend on dp: same tp, pp and micro-batches, cp 2 holds half.
act = {}
for l in lay:
    act.setdefault((l["tp"], l["pp"], l["micro_batch"], l["micro_batches"]), {})[l["cp"]] = l["memory_bytes"]["activations"]
pairs = [v for v in act.values() if len(v) == 2]
assert pairs, "no cp 2 layout with a cp 1 twin"
for v in pairs:
    assert abs(v[2] - v[1] / 2) <= 1e-6 * v[1], v
for l in lay:
    if l["cp"] == 2 and l["feasible"]:
        assert l["ring_bytes"] > 0 and 0 <= l["ring_exposed_seconds"] <= l["ring_seconds"] + 1e-12, l
print("plan cp ok:", len(pairs), "cp 2 layouts against their cp 1 twins")
PY
