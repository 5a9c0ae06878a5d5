#!/usr/bin/env bash
# `tandem train --strategy zero1|zero2|zero3` against --strategy ddp: the same per-step losses
# (within 1e-5 relative; fp32, elementwise AdamW), the per-rank memory the report gives
# (optimizer state 1/N of DDP's; stage 2 gradients 1/N too; stage 3 parameters 1/N too, within
# 10%) and the traffic the Communicator counted (stages 1, 2: DDP's; stage 3: 1.5x, within 10%).
# `tandem train -n 4 --strategy hsdp|hsdp2 --shard-group 2` against ddp on 4 ranks: the same
# losses, and the traffic by group (gathers within the shard groups, an all-reduce across them).
# usage: train_zero.sh TANDEM
set -euo pipefail
tandem=$1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
common=(-n 2 --model mlp --optimizer adamw --lr 0.001 --batch 64 --seed 5 --max-steps 12 --no-eval --no-baseline
        --no-progress --threads 1)
for s in ddp zero1 zero2 zero3; do
  "$tandem" train --strategy "$s" "${common[@]}" --metrics "$out/$s.jsonl" >"$out/log_$s" 2>&1 ||
    { cat "$out/log_$s"; exit 1; }
done
# Hybrid sharding on 4 ranks in shard groups of 2 (ZeRO-3 and ZeRO-2 within each): DDP's losses
# on 4 ranks, all-gathers and reduce-scatters only within the groups, an all-reduce across them.
n4=(-n 4 --model mlp --optimizer adamw --lr 0.001 --batch 64 --seed 5 --max-steps 4 --no-eval --no-baseline
    --no-progress --threads 1)
for s in ddp hsdp hsdp2; do
  group=()
  [[ $s == hsdp* ]] && group=(--shard-group 2)
  "$tandem" train --strategy "$s" "${group[@]}" "${n4[@]}" --metrics "$out/n4_$s.jsonl" >"$out/log_n4_$s" 2>&1 ||
    { cat "$out/log_n4_$s"; exit 1; }
done
for want in "within each shard group of 2: allgather [^;]*reduce_scatter" "across the 2 groups: allreduce"; do
  grep -q "^traffic by group .*$want" "$out/log_n4_hsdp" ||
    { echo "the hsdp report's traffic by group lacks '$want'"; cat "$out/log_n4_hsdp"; exit 1; }
done
grep -q "^traffic by group" "$out/log_zero3" && { echo "zero3 on one group reports traffic by group"; exit 1; }
grep -q "^zero block .* and gathered units, 0 buffer(s) outside it" "$out/log_zero3" ||
  { echo "the zero3 report lacks its shared block"; cat "$out/log_zero3"; exit 1; }
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def load(s):
    steps, rep = [], None
    for line in open(f"{out}/{s}.jsonl"):
        d = json.loads(line)
        if d.get("report"): rep = d
        else: steps.append(d["loss"])
    return steps, rep
ref, rd = load("ddp")
ok = True
for s in ("zero1", "zero2", "zero3"):
    l, r = load(s)
    assert len(l) == len(ref) == 12, (s, len(l), len(ref))
    worst = max(abs(a - b) / abs(b) for a, b in zip(l, ref))
    print(f"{s}: worst relative loss difference from ddp over {len(l)} steps: {worst:.2e}")
    ok &= worst <= 1e-5
    near = lambda a, b: abs(a - b) <= 0.1 * b
    n = r["world_size"]
    checks = {
        "parameters": near(r["parameter_bytes"], rd["parameter_bytes"] / (n if s == "zero3" else 1)),
        "optimizer state": near(r["optimizer_state_bytes"], rd["optimizer_state_bytes"] / n),
        "gradients": near(r["gradient_bytes"], rd["gradient_bytes"] / (1 if s == "zero1" else n)),
    }
    wire, ref_wire = r["wire_bytes_per_step"], rd["wire_bytes_per_step"]
    factor = 1.5 if s == "zero3" else 1.0
    print(f"{s}: {wire / 2**20:.2f} MiB on the wire per step and rank, ddp {ref_wire / 2**20:.2f} MiB "
          f"({wire / ref_wire:.2f}x, expected {factor}x)")
    checks["traffic"] = abs(wire - factor * ref_wire) <= 0.1 * factor * ref_wire
    if s in ("zero2", "zero3"):  # scratch (and stage 3's gathered units) from the shared block
        print(f"{s}: zero block {r['zero_pool_bytes']} bytes, {r['zero_pool_misses']} buffer(s) outside it")
        checks["shared block"] = r["zero_pool_bytes"] > 0 and r["zero_pool_misses"] == 0
    print(f"{s}: bytes params {r['parameter_bytes']} grads {r['gradient_bytes']} optimizer {r['optimizer_state_bytes']}"
          f" (ddp: {rd['parameter_bytes']} {rd['gradient_bytes']} {rd['optimizer_state_bytes']})")
    for k, v in checks.items():
        if not v:
            ok = False
            print(f"FAIL: {s} {k} does not follow the ZeRO model")
ref4, _ = load("n4_ddp")
for s in ("hsdp", "hsdp2"):
    l, r = load(f"n4_{s}")
    worst = max(abs(a - b) / abs(b) for a, b in zip(l, ref4))
    groups = r["comm_group_bytes_per_step"]
    print(f"{s} (groups of {r['shard_group']}): worst relative loss difference from ddp on 4 ranks over {len(l)} "
          f"steps: {worst:.2e}; payload per step by group: {groups}")
    checks = {
        "losses": len(l) == len(ref4) == 4 and worst <= 1e-5,
        "shard group": r["shard_group"] == 2,
        "gathers within the groups": {"allgather", "reduce_scatter"} <= set(groups.get("shard", {})),
        "only an all-reduce across them": set(groups.get("replicate", {})) == {"allreduce"},
        # the world's all-gather is the loop's per-rank figures (bytes), not parameters
        "nothing gathered over the world": groups.get("world", {}).get("allgather", 0) < 1024
                                           and "reduce_scatter" not in groups.get("world", {}),
    }
    for k, v in checks.items():
        if not v:
            ok = False
            print(f"FAIL: {s} {k}")
print("zero train " + ("ok" if ok else "FAILED"))
sys.exit(0 if ok else 1)
PY
