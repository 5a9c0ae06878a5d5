#!/usr/bin/env bash
# examples/resnet_engine, built against the installed package (install_examples.sh): one worker
# with --strategy single must report every step's loss within 1e-5 of plain PyTorch's training of
# the same model (reference_train.py in .venv-hf, part of the test setup) and train (loss down);
# two workers under the installed `tandem launch` with ddp, zero1, zero2 and zero3 must report
# every step's global loss within 1e-5 of one worker's, and each run must leave its final checkpoint.
#
# resnet_engine.sh WORK_DIR SOURCE_DIR
set -euo pipefail
work=$1 source=$2
exe=$work/resnet_engine/resnet_engine
tandem=$work/prefix/bin/tandem
compare=$source/tests/package/compare_losses.py
py=$source/.venv-hf/bin/python
steps=10
out=$work/resnet_engine-runs
rm -rf "$out"
mkdir -p "$out"
cd "$out"

fail() { echo "FAIL: $*" >&2; exit 1; }
[[ -x $py ]] || fail "$py missing (run scripts/setup-hf-venv.sh)"
run() {  # NAME COMMAND...: runs it, its output in NAME.out; fails naming the command
  local name=$1
  shift
  local start=$SECONDS
  "$@" > "$name.out" 2>&1 || { cat "$name.out"; fail "$name: $* exited with $?"; }
  echo "$name: $((SECONDS - start)) s"
}
has_checkpoint() {  # DIR STEP
  compgen -G "$1/step-*$2" > /dev/null || { ls -R "$1" 2>&1 | head -20; fail "no checkpoint of step $2 under $1"; }
}

args=(--steps $steps --batch 64 --lr 0.05 --seed 7)
run single "$exe" "${args[@]}" --strategy single --checkpoint-dir "$out/ckpt-single"
"$py" "$source/tests/package/reference_train.py" resnet_engine "${args[@]}" > pytorch.out 2>&1 ||
  { cat pytorch.out; fail "reference_train.py"; }
python3 "$compare" pytorch.out single.out --steps 1-$steps --tol 1e-5 --decreasing > single.cmp ||
  { cat single.cmp; fail "one worker against PyTorch"; }
tail -1 single.cmp
has_checkpoint "$out/ckpt-single" $steps
for s in ddp zero1 zero2 zero3; do
  run "$s-2" "$tandem" launch -n 2 -- "$exe" "${args[@]}" --strategy $s --checkpoint-dir "$out/ckpt-$s"
  python3 "$compare" single.out "$s-2.out" --steps 1-$steps --tol 1e-5 > "$s.cmp" || { cat "$s.cmp"; fail "$s on 2 workers against one worker"; }
  tail -1 "$s.cmp"
  has_checkpoint "$out/ckpt-$s" $steps
done
echo "ok: ddp, zero1, zero2 and zero3 on 2 workers match one worker within 1e-5 for $steps steps"
