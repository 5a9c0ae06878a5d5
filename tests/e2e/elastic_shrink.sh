#!/usr/bin/env bash
# Elastic run, a host lost for good: `train -n 1:2` on 2 network-namespace hosts; after the
# first checkpoint host 1's link goes down and stays down. The launcher must probe the hosts,
# drop host 1, relaunch 1 worker on host 0 from the newest checkpoint and finish; its per-step
# losses after the cut must equal (1e-6) those of a manual `--resume` with 1 worker from a copy of
# that checkpoint; the report and the metrics file list the change. MODE is
#   grow        --elastic-batch grow: the worker takes the whole global batch;
#   accumulate  --elastic-batch accumulate: 2 micro-batches of 32, as a manual --resume with
#               --grad-accum 2;
#   scale       --elastic-lr scale: the worker keeps its 32 samples, the global batch and the
#               learning rate halve, and the cosine schedule and --max-steps count steps of 64,
#               so twice as many steps follow the cut; the manual --resume is given the same.
# usage: elastic_shrink.sh TANDEM NET_ID grow|accumulate|scale   (exit 77: no netns here)
set -euo pipefail
tandem=$1
NET_ID=$2
mode=$3
source "$(dirname "$0")/elastic_lib.sh"
steps=160

set_flag() {  # set_flag FLAG VALUE: FLAG's value in el_common
  local i
  for i in "${!el_common[@]}"; do
    if [[ ${el_common[i]} == "$1" ]]; then el_common[i + 1]=$2; fi
  done
}
if [[ $mode == scale ]]; then
  set_flag --schedule cosine
  el_common+=(--elastic-lr scale --warmup-steps 30)
else
  el_common+=(--elastic-batch "$mode")
fi
el_start_and_cut -n 1:2 --max-steps "$steps" --metrics "$out/elastic.jsonl"
el_wait_ok
grep -E "elastic: .*2 -> 1 workers \(failure\); lost $h1; resuming from step [0-9]+" "$out/stdout" ||
  el_fail "no membership change 2 -> 1 naming $h1"
resumed=$(grep -oE "2 -> 1 workers \(failure\); lost $h1; resuming from step [0-9]+" "$out/stdout" | head -n1 |
  grep -oE "[0-9]+$")

manual=()
if [[ $mode == accumulate ]]; then
  grep -q "gradient accumulation: 2 micro-batches of about 32 per replica" "$out/stdout" ||
    el_fail "the relaunch on 1 worker does not accumulate 2 micro-batches"
  manual=(--grad-accum 2)
fi
if [[ $mode == scale ]]; then
  # Steps of 32 after the cut: the schedule's 160 steps of 64 end at step resumed + 2 x (160 - resumed).
  steps=$((resumed + 2 * (160 - resumed)))
  grep -qE "^steps +$steps \(global batch 32," "$out/stdout" ||
    el_fail "the relaunch on 1 worker did not end at step $steps at global batch 32"
  set_flag --batch 32
  set_flag --lr 0.0005
  el_max_steps=160
else
  grep -q "^steps *$steps " "$out/stdout" || el_fail "the run did not reach step $steps"
fi
el_same_as_manual "$resumed" 1 ${manual[@]+"${manual[@]}"}
if [[ $mode == scale ]]; then
  # Its checkpoints count the schedule in steps of 64: a resume without the flag is refused.
  set_flag --elastic-lr keep
  if "$tandem" train -n 1 "${el_common[@]}" --checkpoint-dir "$out/manual" --resume --max-steps 160 \
    >"$out/stdout-noflag" 2>&1; then
    el_fail "a scaled run's checkpoint resumed without --elastic-lr scale"
  fi
  grep -q "by an elastic run with --elastic-lr scale .*resume it with --elastic-lr scale" "$out/stdout-noflag" ||
    el_fail "no message naming --elastic-lr scale: $(tail -n 3 "$out/stdout-noflag")"
fi
python3 - "$out" "$resumed" "$h1" <<'PY' || el_fail "the metrics file does not list the change"
import json, sys
out, resumed, lost = sys.argv[1], int(sys.argv[2]), sys.argv[3]
changes = [json.loads(l)["membership"] for l in open(f"{out}/elastic.jsonl") if "membership" in l]
print(f"metrics: {changes}")
assert len(changes) == 1, changes
c = changes[0]
assert (c["old_workers"], c["new_workers"], c["lost"], c["regained"], c["resume_step"], c["reason"]) == \
    (2, 1, [lost], [], resumed, "failure"), c
PY
echo "elastic shrink ok"
