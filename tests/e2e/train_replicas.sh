#!/usr/bin/env bash
# `tandem train --replicas K` (K replica threads in one process) against -n K worker processes,
# and -n 2 --replicas 2 against -n 4: the same per-step losses within 1e-5 over 20 steps, for
# DDP (the CNN; the MLP for 4) and ZeRO-2 (the MLP); then bad input, each a clear message, a
# non-zero exit and no hang.
# usage: train_replicas.sh TANDEM
set -uo pipefail
tandem=$1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
run() {  # run NAME ARGS...: a training run whose metrics land in $out/NAME.jsonl
  local name=$1; shift
  timeout 300 "$tandem" train "$@" --seed 3 --max-steps 20 --no-eval --no-baseline --no-progress \
    --metrics "$out/$name.jsonl" >"$out/log_$name" 2>&1 || { echo "FAIL: run $name"; cat "$out/log_$name"; exit 1; }
}
# lr and schedule as train_parity.sh: other summation orders stay far below the tolerance.
cnn=(--model cnn --strategy ddp --batch 128 --lr 0.02 --schedule constant)
mlp=(--model mlp --strategy zero2 --optimizer adamw --lr 0.001 --batch 64)
run ddp_procs -n 2 "${cnn[@]}"
run ddp_replicas --replicas 2 "${cnn[@]}"
run zero2_procs -n 2 "${mlp[@]}"
run zero2_replicas --replicas 2 "${mlp[@]}"
# Two processes of two replicas each against four processes: DDP and ZeRO-2 on the MLP.
mlp_ddp=(--model mlp --strategy ddp --optimizer adamw --lr 0.001 --batch 64)
run ddp4_procs -n 4 "${mlp_ddp[@]}"
run ddp4_replicas -n 2 --replicas 2 "${mlp_ddp[@]}"
run zero24_procs -n 4 "${mlp[@]}"
run zero24_replicas -n 2 --replicas 2 "${mlp[@]}"
grep -q "^training 2 replicas in this process" "$out/log_ddp_replicas" ||
  { echo "FAIL: --replicas 2 did not say it trains 2 replicas in one process"; cat "$out/log_ddp_replicas"; exit 1; }
python3 - "$out" <<'PY' || exit 1
import json, sys
out = sys.argv[1]
def load(name):
    steps, rep = [], None
    for line in open(f"{out}/{name}.jsonl"):
        d = json.loads(line)
        if d.get("report"): rep = d
        else: steps.append(d["loss"])
    return steps, rep
ok = True
for s, world, what in (("ddp", 2, "--replicas 2 against -n 2"), ("zero2", 2, "--replicas 2 against -n 2"),
                      ("ddp4", 4, "-n 2 --replicas 2 against -n 4"), ("zero24", 4, "-n 2 --replicas 2 against -n 4")):
    ref, rp = load(f"{s}_procs")
    got, rr = load(f"{s}_replicas")
    assert len(ref) == len(got) == 20, (s, len(ref), len(got))
    assert rr["world_size"] == rp["world_size"] == world, (rr["world_size"], rp["world_size"])
    worst = max(abs(a - b) for a, b in zip(got, ref))
    print(f"{s}: {what}, worst loss difference over 20 steps: {worst:.2e}")
    ok &= worst <= 1e-5
print("replica parity " + ("holds" if ok else "FAILED"))
sys.exit(0 if ok else 1)
PY

fails=0
expect() {  # expect NAME PATTERN -- command...
  local name=$1 pattern=$2; shift 3
  local start=$SECONDS
  timeout 60 "$@" >"$out/bad" 2>&1
  local rc=$?
  if [ $rc -eq 0 ] || [ $rc -eq 124 ] || ! grep -qE -- "$pattern" "$out/bad"; then
    echo "FAIL $name (exit $rc, $((SECONDS - start)) s); output:"; sed 's/^/    /' "$out/bad" | tail -20
    fails=$((fails + 1))
  else
    echo "ok   $name (exit $rc, $((SECONDS - start)) s): $(grep -m1 -E -- "$pattern" "$out/bad")"
  fi
}
expect replicas-zero "--replicas 0: a process trains at least 1 replica" -- "$tandem" train --replicas 0
expect replicas-negative "--replicas -2: a process trains at least 1 replica" -- "$tandem" train --replicas -2
expect replicas-uneven-batch "--batch 127 \\(global\\) does not split evenly over 2 workers" -- \
  "$tandem" train --replicas 2 --batch 127 --no-baseline
expect replicas-processes-tp "--replicas 2 with -n 2: --tp and --pp split the replicas" -- \
  "$tandem" train --replicas 2 -n 2 --tp 2 --model mlp --no-baseline
expect replicas-processes-cuda "--replicas 2 with -n 2 runs on the CPU only" -- \
  "$tandem" train --replicas 2 -n 2 --device cuda --no-baseline
if ! nvidia-smi -L >/dev/null 2>&1; then  # no GPU here: CUDA is refused
  expect replicas-cuda "--device cuda was asked for, but this process sees no CUDA device" -- \
    "$tandem" train --replicas 2 --device cuda --no-baseline --max-steps 1
fi
expect replicas-restarts "--max-restarts relaunches worker processes; it does not apply to --replicas" -- \
  "$tandem" train --replicas 2 --max-restarts 1 --checkpoint-dir "$out/ck" --no-baseline
expect replicas-single "strategy single runs one worker" -- \
  "$tandem" train --replicas 2 --strategy single --no-baseline
[ $fails -eq 0 ] || { echo "$fails bad-input case(s) failed"; exit 1; }
