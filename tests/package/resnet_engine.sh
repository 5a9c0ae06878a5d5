#!/usr/bin/env bash
# examples/resnet_engine, built against the installed package (install_examples.sh): one worker
# with --strategy single is the reference; two workers under the installed `tandem launch` with
# ddp, zero1, zero2 and zero3 must report every step's global loss within 1e-5 of it, and each
# run must leave its final checkpoint. The reference must also have trained (loss down).
#
# resnet_engine.sh WORK_DIR SOURCE_DIR
set -euo pipefail
work=$1 source=$2
exe=$work/resnet_engine/resnet_engine
tandem=$work/prefix/bin/tandem
compare=$source/tests/package/compare_losses.py
steps=10
out=$work/resnet_engine-runs
rm -rf "$out"
mkdir -p "$out"
cd "$out"

fail() { echo "FAIL: $*" >&2; exit 1; }
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
python3 "$compare" single.out single.out --steps 1-$steps --tol 0 --decreasing > single.cmp || { cat single.cmp; fail "the reference run"; }
has_checkpoint "$out/ckpt-single" $steps
for s in ddp zero1 zero2 zero3; do
  run "$s-2" "$tandem" launch -n 2 -- "$exe" "${args[@]}" --strategy $s --checkpoint-dir "$out/ckpt-$s"
  python3 "$compare" single.out "$s-2.out" --steps 1-$steps --tol 1e-5 > "$s.cmp" || { cat "$s.cmp"; fail "$s on 2 workers against one worker"; }
  tail -1 "$s.cmp"
  has_checkpoint "$out/ckpt-$s" $steps
done
echo "ok: ddp, zero1, zero2 and zero3 on 2 workers match one worker within 1e-5 for $steps steps"
