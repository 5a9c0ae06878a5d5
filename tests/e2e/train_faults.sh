#!/usr/bin/env bash
# Faults in `tandem train`, as a user meets them:
#   kill     rank 1 of a 2-worker DDP run is killed with SIGKILL mid-training (after its first
#            checkpoint): the launcher must exit non-zero within 30 s naming rank 1.
#   restart  the same with --max-restarts 1: the job relaunches from the newest checkpoint and
#            finishes all its steps (exit 0).
#   restart1 as restart, with one worker (-n 1 --strategy single), which is then killed.
# usage: train_faults.sh TANDEM kill|restart|restart1
set -euo pipefail
tandem=$1
mode=$2
out=$(mktemp -d)
launcher=
cleanup() {
  [[ -n "$launcher" ]] && kill -9 "$launcher" 2>/dev/null || true
  rm -rf "$out"
}
trap cleanup EXIT
victim_rank=1
workers=(-n 2 --strategy ddp)
if [[ "$mode" == restart1 ]]; then
  victim_rank=0
  workers=(-n 1 --strategy single)
fi
common=("${workers[@]}" --model mlp --optimizer adamw --lr 0.001 --batch 64 --seed 5 --no-eval --no-baseline
        --no-progress --threads 1 --checkpoint-dir "$out/ck" --checkpoint-every 20 --timeout 20)
if [[ "$mode" == kill ]]; then
  "$tandem" train "${common[@]}" --epochs 50 >"$out/stdout" 2>"$out/stderr" &
else
  "$tandem" train "${common[@]}" --max-steps 400 --max-restarts 1 >"$out/stdout" 2>"$out/stderr" &
fi
launcher=$!

# The pid of the worker whose MPI rank is $1.
rank_pid() {
  local p
  for p in $(pgrep -f -- "$tandem train" || true); do
    if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$1"; then
      echo "$p"
      return 0
    fi
  done
  return 1
}
for _ in $(seq 1 600); do
  [[ -f "$out/ck/step-00000020/manifest.json" ]] && break
  kill -0 "$launcher" 2>/dev/null || { echo "FAIL: the run ended before its first checkpoint"; cat "$out/stdout" "$out/stderr"; exit 1; }
  sleep 0.1
done
[[ -f "$out/ck/step-00000020/manifest.json" ]] || { echo "FAIL: no checkpoint after 60 s"; exit 1; }
victim=$(rank_pid "$victim_rank") || { echo "FAIL: rank $victim_rank not found"; exit 1; }
t0=$(date +%s.%N)
kill -KILL "$victim"
echo "killed rank $victim_rank (pid $victim) after $(ls "$out/ck" | grep -c '^step-') checkpoint(s)"
set +e
wait "$launcher"
rc=$?
set -e
launcher=
t1=$(date +%s.%N)
elapsed=$(python3 -c "print(f'{$t1 - $t0:.1f}')")
echo "launcher exit code $rc, $elapsed s after the kill"
tail -n 5 "$out/stderr"
if [[ "$mode" == kill ]]; then
  [[ $rc -ne 0 ]] || { echo "FAIL: exit code 0 after a rank was killed"; exit 1; }
  grep -q "rank 1 was killed by signal 9" "$out/stderr" || { echo "FAIL: the lost rank is not named"; cat "$out/stderr"; exit 1; }
  python3 -c "import sys; sys.exit(0 if $elapsed <= 30 else 1)" || { echo "FAIL: took more than 30 s"; exit 1; }
  echo "kill ok"
else
  [[ $rc -eq 0 ]] || { echo "FAIL: the restarted job failed"; cat "$out/stdout" "$out/stderr"; exit 1; }
  grep -q "restart 1 of 1" "$out/stderr" || { echo "FAIL: no restart message"; cat "$out/stderr"; exit 1; }
  grep -q "resuming from .*step-" "$out/stdout" || { echo "FAIL: the restart did not resume"; cat "$out/stdout"; exit 1; }
  grep -q "^steps *400 " "$out/stdout" || { echo "FAIL: the restarted job did not reach step 400"; cat "$out/stdout"; exit 1; }
  echo "restart ok"
fi
