#!/usr/bin/env bash
# examples/plugin, built against the installed package (install_examples.sh), trained by the
# installed `tandem train --model path/libmynet.so`: its model and its dataset (the plugin's
# default) under ddp and zero3 on 2 workers and single on one. Every run must report the
# plugin's model, train (the loss goes down), evaluate on the plugin's test split, and the
# 2-worker runs must follow one worker step by step (same global batch, same seed).
#
# plugin.sh WORK_DIR SOURCE_DIR
set -euo pipefail
work=$1 source=$2
plugin=$work/plugin/libmynet.so
tandem=$work/prefix/bin/tandem
out=$work/plugin-runs
rm -rf "$out"
mkdir -p "$out"
cd "$out"

fail() { echo "FAIL: $*" >&2; exit 1; }
[[ -f $plugin ]] || fail "$plugin was not built (package_install_examples)"
common=(--model "$plugin" --max-steps 30 --batch 64 --lr 0.2 --seed 3 --no-progress --no-baseline --threads 1)
run() {  # NAME ARGS...: a training run, its output in NAME.out and its losses in NAME.jsonl
  local name=$1
  shift
  "$tandem" train "${common[@]}" --metrics "$out/$name.jsonl" "$@" > "$name.out" 2>&1 ||
    { cat "$name.out"; fail "$name: tandem train $* exited with $?"; }
  grep -q "model            tiny_mlp" "$name.out" || { cat "$name.out"; fail "$name: the report does not name tiny_mlp"; }
  grep -q "test accuracy .*(500 samples)" "$name.out" || { cat "$name.out"; fail "$name: no evaluation on the plugin's 500 test samples"; }
}
run single -n 1 --strategy single
run ddp -n 2 --strategy ddp
run zero3 -n 2 --strategy zero3
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def losses(name):
    return [r["loss"] for r in map(json.loads, open(f"{out}/{name}.jsonl")) if "loss" in r]
ref = losses("single")
assert len(ref) == 30, f"single: {len(ref)} steps, expected 30"
assert ref[-1] < 0.8 * ref[0], f"single: the loss did not go down ({ref[0]:.4f} -> {ref[-1]:.4f})"
for name in ("ddp", "zero3"):
    got = losses(name)
    worst = max(abs(a - b) for a, b in zip(got, ref))
    assert len(got) == len(ref) and worst < 1e-5, f"{name}: {len(got)} steps, largest difference {worst:.3g}"
    print(f"{name} on 2 workers: 30 steps within {worst:.2g} of one worker")
PY
echo "ok: the plugin's model trains on its dataset under single, ddp and zero3"
