#!/usr/bin/env bash
# `tandem train --optimizer lamb|lars` on two workers (ZeRO-2, ZeRO-1) against one worker: the
# same per-step losses within 1e-5 relative (the trust ratios see whole-parameter norms though
# ZeRO cuts the parameters), and the losses fall. usage: train_layerwise.sh TANDEM
set -euo pipefail
tandem=$1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
common=(--model mlp --batch 64 --seed 5 --max-steps 12 --no-eval --no-baseline --no-progress --threads 1
        --weight-decay 0.01)
run() {  # run NAME ARGS...
  local name=$1; shift
  "$tandem" train "$@" "${common[@]}" --metrics "$out/$name.jsonl" >"$out/log_$name" 2>&1 ||
    { cat "$out/log_$name"; exit 1; }
}
run lamb_one -n 1 --strategy single --optimizer lamb --lr 0.01
run lamb_zero2 -n 2 --strategy zero2 --optimizer lamb --lr 0.01
run lars_one -n 1 --strategy single --optimizer lars --lr 2 --trust-coefficient 0.01
run lars_zero1 -n 2 --strategy zero1 --optimizer lars --lr 2 --trust-coefficient 0.01
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def losses(name):
    return [d["loss"] for d in map(json.loads, open(f"{out}/{name}.jsonl")) if not d.get("report")]
ok = True
for kind, layout in (("lamb", "zero2"), ("lars", "zero1")):
    ref, got = losses(f"{kind}_one"), losses(f"{kind}_{layout}")
    assert len(ref) == len(got) == 12, (kind, len(ref), len(got))
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    print(f"{kind} {layout}: worst relative loss difference from one worker over 12 steps: {worst:.2e}; "
          f"loss {ref[0]:.3f} -> {ref[-1]:.3f}")
    ok &= worst <= 1e-5 and ref[-1] < ref[0]
sys.exit(0 if ok else 1)
PY
