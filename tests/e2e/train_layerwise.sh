#!/usr/bin/env bash
# `tandem train --optimizer lamb|lars` on two workers (ZeRO-2, ZeRO-1) against one worker: the
# same per-step losses within 1e-5 relative (the trust ratios see whole-parameter norms though
# ZeRO cuts the parameters), and the losses fall; LARS saved halfway under --tp 2 and resumed
# under ZeRO-2 continues the one worker's losses. usage: train_layerwise.sh TANDEM
set -euo pipefail
tandem=$1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# A constant learning rate: the run cut at step 6 then has the schedule of the whole run.
common=(--model mlp --batch 64 --seed 5 --schedule constant --no-eval --no-baseline --no-progress --threads 1
        --weight-decay 0.01)
run() {  # run NAME ARGS...
  local name=$1; shift
  "$tandem" train "$@" "${common[@]}" --max-steps 12 --metrics "$out/$name.jsonl" >"$out/log_$name" 2>&1 ||
    { cat "$out/log_$name"; exit 1; }
}
run lamb_one -n 1 --strategy single --optimizer lamb --lr 0.01
run lamb_zero2 -n 2 --strategy zero2 --optimizer lamb --lr 0.01
run lars_one -n 1 --strategy single --optimizer lars --lr 2 --trust-coefficient 0.01
run lars_zero1 -n 2 --strategy zero1 --optimizer lars --lr 2 --trust-coefficient 0.01
lars=(--optimizer lars --lr 2 --trust-coefficient 0.01 --checkpoint-dir "$out/ckpt" --checkpoint-every 6)
"$tandem" train -n 2 --tp 2 "${lars[@]}" "${common[@]}" --max-steps 6 >"$out/log_lars_tp2" 2>&1 ||
  { cat "$out/log_lars_tp2"; exit 1; }
run lars_resumed -n 2 --strategy zero2 "${lars[@]}" --resume
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def losses(name):
    return [d["loss"] for d in map(json.loads, open(f"{out}/{name}.jsonl")) if not d.get("report")]
ok = True
for kind, layout in (("lamb", "zero2"), ("lars", "zero1"), ("lars", "resumed")):
    ref, got = losses(f"{kind}_one"), losses(f"{kind}_{layout}")
    first = len(ref) - len(got)  # the resumed run logs steps 7-12
    assert len(ref) == 12 and len(got) == (6 if layout == "resumed" else 12), (kind, layout, len(ref), len(got))
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref[first:]))
    print(f"{kind} {layout}: worst relative loss difference from one worker over {len(got)} steps: {worst:.2e}; "
          f"loss {ref[0]:.3f} -> {ref[-1]:.3f}")
    ok &= worst <= 1e-5 and ref[-1] < ref[0]
sys.exit(0 if ok else 1)
PY
