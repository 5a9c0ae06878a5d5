#!/usr/bin/env bash
# examples/custom_loop_ddp, built against the installed package (install_examples.sh): two
# workers train 10 steps and save a checkpoint at step 5 (the uninterrupted run), whose losses
# must be within 1e-5 of plain PyTorch's training of the same model on the same global batches
# (reference_train.py in .venv-hf, part of the test setup) and fall; then two
# workers, and one worker, resume from that checkpoint: their steps 6-10 must equal the
# uninterrupted run's (two workers: the same arithmetic, 1e-6; one worker: 1e-5).
#
# custom_loop_ddp.sh WORK_DIR SOURCE_DIR
set -euo pipefail
work=$1 source=$2
exe=$work/custom_loop_ddp/custom_loop_ddp
tandem=$work/prefix/bin/tandem
compare=$source/tests/package/compare_losses.py
py=$source/.venv-hf/bin/python
out=$work/custom_loop_ddp-runs
rm -rf "$out"
mkdir -p "$out"
cd "$out"

fail() { echo "FAIL: $*" >&2; exit 1; }
[[ -x $py ]] || fail "$py missing (run scripts/setup-hf-venv.sh)"
run() {  # NAME COMMAND...
  local name=$1
  shift
  local start=$SECONDS
  "$@" > "$name.out" 2>&1 || { cat "$name.out"; fail "$name: $* exited with $?"; }
  echo "$name: $((SECONDS - start)) s"
}
check() {  # REFERENCE RUN ARGS... (compare_losses.py)
  python3 "$compare" "$@" > "$2.cmp" || { cat "$2.cmp"; fail "$2 against $1"; }
  tail -1 "$2.cmp"
}

args=(--steps 10 --batch 64 --lr 0.05 --seed 3 --checkpoint-dir "$out/ckpt")
run full "$tandem" launch -n 2 -- "$exe" "${args[@]}" --save-at 5
"$py" "$source/tests/package/reference_train.py" custom_loop_ddp --steps 10 --batch 64 --lr 0.05 --seed 3 \
  > pytorch.out 2>&1 || { cat pytorch.out; fail "reference_train.py"; }
check pytorch.out full.out --steps 1-10 --tol 1e-5 --decreasing
grep -q "saved .*step-0*5$" full.out || { cat full.out; fail "the run saved no checkpoint at step 5"; }
# Resumed runs save nothing: the checkpoint of step 5 stays the newest for the next resume.
run resume-2 "$tandem" launch -n 2 -- "$exe" "${args[@]}" --resume
grep -q "resumed from .*step-0*5 at step 5" resume-2.out || { cat resume-2.out; fail "2 workers did not resume at step 5"; }
check full.out resume-2.out --steps 6-10 --tol 1e-6
run resume-1 "$exe" "${args[@]}" --resume
check full.out resume-1.out --steps 6-10 --tol 1e-5
echo "ok: resuming at step 5 continues the uninterrupted run's losses on 2 and on 1 worker"
