#!/usr/bin/env bash
# Batch shares for heterogeneous clusters (`tandem train --batch-shares`).
#  parity:    the MLP on 2 workers with shares 3:1 and auto (ddp and zero3; rank 1 slowed by
#             --slow-rank, so the calibration must give it the smaller share: under zero3 the
#             fast rank's forward waits for the slow one's parameter gathers, which must not
#             count), counts:80,48 (zero2) and 2,1 (zero3) must follow the equal-share run's per-step loss within 1e-4 relative over
#             20 steps; a 3:1 run resumed from a checkpoint at step 10 continues the same losses;
#             one worker with --batch-shares auto is the plain single run. The report
#             and the metrics JSON carry the shares and per-rank samples/s.
#  bad-input: zero, negative, too many, badly summing shares, a rank left with 0 samples, a bad
#             --slow-rank, shares with --tp: each a clear error, before launch.
# usage: train_shares.sh TANDEM parity|bad-input
set -uo pipefail
tandem=$1
mode=$2
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

if [ "$mode" = bad-input ]; then
  fails=0
  expect() {  # expect NAME PATTERN -- command...: fails fast with a message matching PATTERN
    local name=$1 pattern=$2; shift 3
    if "$here/expect_run.sh" --exit nonzero --within 60 --stderr "$pattern" -- "$@" >"$out/o"; then
      echo "ok   $name ($(grep -m1 '^exit status' "$out/o"))"
    else
      echo "FAIL $name:"; sed 's/^/    /' "$out/o" | tail -20
      fails=$((fails + 1))
    fi
  }
  t=("$tandem" train -n 2 --model mlp --no-baseline --max-steps 1)
  expect zero-share "rank 1's share is 0; every share must be positive" -- "${t[@]}" --batch-shares 3,0
  expect negative-share "rank 0's share is -1" -- "${t[@]}" --batch-shares=-1,2
  expect not-a-number "'x' is not a number" -- "${t[@]}" --batch-shares 3,x
  expect wrong-count "3 share\(s\) for 2 data-parallel worker\(s\); give exactly one per worker" -- \
    "${t[@]}" --batch-shares 3,1,1
  expect counts-sum "counts:96,30 sum to 126 samples, not the global --batch 128" -- \
    "${t[@]}" --batch 128 --batch-shares counts:96,30
  expect zero-count "a rank with no samples is not allowed" -- "${t[@]}" --batch-shares counts:128,0
  expect weight-leaves-zero "rank 1's weight leaves it 0 of the 128 samples" -- \
    "${t[@]}" --batch 128 --batch-shares 1000,1
  expect slow-rank-range "--slow-rank 5:1: rank 5 is not one of the 2 worker" -- "${t[@]}" --slow-rank 5:1
  expect slow-rank-format "expected RANK:MS" -- "${t[@]}" --slow-rank 1
  expect calibration-steps "--calibration-steps must be at least 2" -- \
    "${t[@]}" --batch-shares auto --calibration-steps 1
  expect with-tp "applies to pure data parallelism" -- "${t[@]}" --tp 2 --batch-shares 1,1
  echo "$fails failed"
  [ $fails -eq 0 ]
  exit
fi

set -e
common=(--model mlp --batch 128 --seed 3 --lr 0.02 --schedule constant --no-eval --no-baseline --no-progress)
run() {  # run NAME STEPS ARGS...
  local name=$1 steps=$2; shift 2
  local start=$SECONDS
  "$tandem" train "${common[@]}" --max-steps "$steps" --metrics "$out/$name.jsonl" "$@" >"$out/$name.log" 2>&1 ||
    { echo "FAIL: $name exited non-zero:"; cat "$out/$name.log"; exit 1; }
  echo "ran $name in $((SECONDS - start)) s: $(grep -m1 'batch shares' "$out/$name.log" || true)"
}
run ddp_equal 20 -n 2
run ddp_3to1 20 -n 2 --batch-shares 3,1
run ddp_auto 20 -n 2 --batch-shares auto --calibration-steps 5 --slow-rank 1:2
run zero2_equal 20 -n 2 --strategy zero2
run zero2_counts 20 -n 2 --strategy zero2 --batch-shares counts:80,48
run zero3_equal 20 -n 2 --strategy zero3
run zero3_2to1 20 -n 2 --strategy zero3 --batch-shares 2,1
run zero3_auto 20 -n 2 --strategy zero3 --batch-shares auto --calibration-steps 5 --slow-rank 1:2
# Checkpoint after 10 steps with shares 3:1, resume to 20: steps 11-20 must be ddp_3to1's.
run ddp_3to1_first 10 -n 2 --batch-shares 3,1 --checkpoint-dir "$out/ckpt" --checkpoint-every 10
run ddp_3to1_resumed 20 -n 2 --batch-shares 3,1 --checkpoint-dir "$out/ckpt" --resume
run single 20 -n 1 --strategy single
run single_auto 20 -n 1 --strategy single --batch-shares auto
grep -q "^rank throughput  rank 0 .* samples/s (forward .*), rank 1 " "$out/ddp_3to1.log" ||
  { echo "FAIL: no per-rank throughput line in the report:"; cat "$out/ddp_3to1.log"; exit 1; }
python3 - "$out" "$here" <<'PY'
import sys
out = sys.argv[1]
sys.path.insert(0, sys.argv[2])
import metrics
def load(name):
    return metrics.load(f"{out}/{name}.jsonl")
ok = True
def check(cond, msg):
    global ok
    if not cond:
        ok = False
        print("FAIL: " + msg)
for name, ref in (("ddp_3to1", "ddp_equal"), ("ddp_auto", "ddp_equal"), ("zero2_counts", "zero2_equal"),
                  ("zero3_2to1", "zero3_equal"), ("zero3_auto", "zero3_equal"), ("single_auto", "single")):
    l, _ = load(name)
    r, _ = load(ref)
    check(len(l) == len(r) == 20, f"{name}: {len(l)} steps, {ref}: {len(r)}, expected 20")
    worst = max(abs(a - b) / abs(b) for a, b in zip(l, r))
    print(f"{name} vs {ref}: worst relative loss difference over {len(l)} steps: {worst:.2e}")
    check(worst <= 1e-4, f"{name}'s loss differs from {ref}'s by {worst:.2e} > 1e-4")
l, _ = load("ddp_3to1_resumed")
r, _ = load("ddp_3to1")
check(len(l) == 10, f"the resumed run did {len(l)} steps, expected 10")
worst = max(abs(a - b) / abs(b) for a, b in zip(l, r[10:]))
print(f"ddp_3to1 resumed at step 10 vs uninterrupted: worst relative loss difference {worst:.2e}")
check(worst <= 1e-6, f"resuming with shares changed the losses by {worst:.2e}")
_, rep = load("ddp_equal")
check(rep["batch_shares_mode"] == "equal" and rep["batch_shares"] == [64, 64], f"equal run: {rep.get('batch_shares')}")
_, rep = load("ddp_3to1")
check(rep["batch_shares_mode"] == "weights" and rep["batch_shares"] == [96, 32], f"3,1 run: {rep.get('batch_shares')}")
check(len(rep["rank_samples_per_second"]) == 2 and all(v > 0 for v in rep["rank_samples_per_second"]),
      f"per-rank samples/s: {rep.get('rank_samples_per_second')}")
# Rank 0 processed three times rank 1's samples in the same wall time.
a, b = rep["rank_samples_per_second"]
check(abs(a / b - 3) < 0.01, f"3,1 run: per-rank samples/s {a:.0f}, {b:.0f} are not 3:1")
_, rep = load("zero2_counts")
check(rep["batch_shares"] == [80, 48], f"counts run: {rep.get('batch_shares')}")
_, rep = load("zero3_2to1")
check(rep["batch_shares"] == [85, 43], f"2,1 run: {rep.get('batch_shares')}")
for name in ("ddp_auto", "zero3_auto"):
    _, rep = load(name)
    s, rates = rep["batch_shares"], rep["calibrated_samples_per_second"]
    print(f"{name}: shares {s}, calibrated forward samples/s {[round(x) for x in rates]}")
    check(rep["batch_shares_mode"] == "auto" and len(rates) == 2 and sum(s) == 128,
          f"{name}: shares {s}, rates {rates}")
    # Rank 1 sleeps 2 ms per sample (part of it in the forward window): it forwards several
    # times slower than rank 0, and must get well under half of the batch.
    check(s[1] < s[0] / 2 and rates[1] < rates[0] / 2,
          f"{name}: the slowed rank 1 should get much the smaller share: {s}, rates {rates}")
print("shares parity " + ("holds" if ok else "FAILED"))
sys.exit(0 if ok else 1)
PY
