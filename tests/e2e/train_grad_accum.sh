#!/usr/bin/env bash
# Gradient accumulation (`tandem train --grad-accum K`): K micro-batches per step must follow
# the same per-step losses as one batch of the same global size (within 1e-5 relative over 12
# steps of the MLP) for one worker, DDP, ZeRO-1 and -3 and tensor parallelism, also when K does
# not divide a rank's batch; DDP and ZeRO-1 must communicate once per step (the bytes of K = 1),
# ZeRO-3 reduce-scatter once per micro-batch (K times the bytes); the report names it.
# usage: train_grad_accum.sh TANDEM
set -euo pipefail
tandem=$1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
common=(--model mlp --batch 96 --seed 5 --lr 0.02 --schedule constant --max-steps 12 --no-eval --no-baseline
        --no-progress)
run() {  # run NAME ARGS...
  local name=$1; shift
  "$tandem" train "${common[@]}" "$@" --metrics "$out/$name.jsonl" >"$out/$name.log" 2>&1 ||
    { echo "FAIL: tandem train $* exited non-zero:"; cat "$out/$name.log"; exit 1; }
}
run ref -n 1 --strategy single
run single4 -n 1 --strategy single --grad-accum 4
run ddp1 -n 2 --strategy ddp
run ddp4 -n 2 --strategy ddp --grad-accum 4
run ddp5 -n 2 --strategy ddp --grad-accum 5   # 48 samples per rank: 10, 10, 10, 9, 9
run zero1_1 -n 2 --strategy zero1
run zero1_3 -n 2 --strategy zero1 --grad-accum 3
run zero3_4 -n 2 --strategy zero3 --grad-accum 4
run tp2_4 -n 2 --strategy ddp --tp 2 --grad-accum 4
grep -q "gradient accumulation: 4 micro-batches of about 12 per replica" "$out/ddp4.log" ||
  { echo "FAIL: the report does not name the accumulation:"; cat "$out/ddp4.log"; exit 1; }
python3 - "$out" "$(dirname "$0")" <<'PY'
import sys
out = sys.argv[1]
sys.path.insert(0, sys.argv[2])
from metrics import load
ref, _ = load(f"{out}/ref.jsonl")
ok = True
for name in ("single4", "ddp4", "ddp5", "zero1_3", "zero3_4", "tp2_4"):
    losses, rep = load(f"{out}/{name}.jsonl")
    assert len(losses) == len(ref) == 12, (name, len(losses), len(ref))
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
    print(f"{name}: grad_accum {rep['grad_accum']}, worst relative loss difference over 12 steps {worst:.1e}")
    if worst > 1e-5:
        ok = False
        print(f"FAIL: {name} does not follow one batch of 96")
def per_step(name, op):
    _, rep = load(f"{out}/{name}.jsonl")
    return rep["comm_bytes_per_step"].get(op, 0.0)
a1, a4 = per_step("ddp1", "allreduce"), per_step("ddp4", "allreduce")
print(f"DDP all-reduce bytes per step: {a1:.0f} without accumulation, {a4:.0f} with 4 micro-batches")
if not (a1 > 0 and abs(a4 - a1) <= 0.01 * a1):
    ok = False
    print("FAIL: DDP must all-reduce once per step under accumulation (no_sync before the last micro-batch)")
r1, r3 = per_step("zero1_1", "reduce_scatter"), per_step("zero1_3", "reduce_scatter")
print(f"ZeRO-1 reduce-scatter bytes per step: {r1:.0f} without accumulation, {r3:.0f} with 3 micro-batches")
if not (r1 > 0 and abs(r3 - r1) <= 0.01 * r1):
    ok = False
    print("FAIL: ZeRO-1 must reduce-scatter once per step under accumulation (no_sync before the last micro-batch)")
z3 = per_step("zero3_4", "reduce_scatter")
print(f"ZeRO-3 reduce-scatter bytes per step with 4 micro-batches: {z3:.0f}")
if not abs(z3 - 4 * r1) <= 0.05 * r1:
    ok = False
    print("FAIL: ZeRO-3 must reduce-scatter once per micro-batch (4 x ZeRO-1's bytes)")
print("gradient accumulation " + ("holds" if ok else "FAILED"))
sys.exit(0 if ok else 1)
PY
