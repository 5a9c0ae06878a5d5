# Shared by tests/e2e/elastic_*.sh (source it after setting NET_ID and tandem): two
# network-namespace hosts h0 and h1 with one slot each (tests/netns, through multinode_lib.sh),
# the hostfile $out/hostfile, and:
#   el_run ARGS...       `tandem train -n ... --hostfile` on the launcher host: the MLP, DDP,
#                        global batch $el_batch (default 64), checkpoints every 20 steps in
#                        $out/ck, a short communication timeout
#   el_start_and_cut ARGS...
#                        starts el_run ARGS in the background ($job; output in $out/stdout and
#                        $out/stderr) and takes h1's link down once the first checkpoint is in
#   el_wait_for FILE S   waits up to S seconds for FILE while $job runs (fails otherwise)
#   el_cut_after STEP S  waits up to S seconds for checkpoint STEP, then takes h1's link down
#   el_newest            the newest complete checkpoint's step
#   el_same_as_manual FROM WORKERS [ARGS...]
#                        runs a manual `--resume` on WORKERS workers of this machine (and ARGS)
#                        from a copy of checkpoint step FROM to step $steps, and fails unless its per-step
#                        losses equal those of $out/elastic.jsonl (the elastic run's last part)
#                        within 1e-6 (--max-steps $el_max_steps when set: a schedule that counts
#                        steps of another batch)
#   el_compare_losses FROM WORKERS [OLD:NEW]
#                        that comparison of $out/elastic.jsonl and $out/manual.jsonl (steps FROM
#                        to $steps); with OLD:NEW, the one membership change the run recorded
source "$(dirname "${BASH_SOURCE[0]}")/multinode_lib.sh"
h0="tdm$NET_ID-h0" h1="tdm$NET_ID-h1"
mn_hosts "$h0" "$h1"
printf '%s slots=1\n' "$h0" "$h1" >"$out/hostfile"
el_common=(--strategy ddp --model mlp --optimizer adamw --lr 0.001 --batch "${el_batch:-64}" --seed 5 --schedule constant
           --no-eval --no-baseline --no-progress --threads 1 --checkpoint-every 20)

el_run() {
  mn_launch "$tandem" train --hostfile "$out/hostfile" --net-if "$mn_net" "${el_common[@]}" \
    --checkpoint-dir "$out/ck" --timeout 6 "$@"
}

el_fail() {
  echo "FAIL: $*"
  for f in "$out"/stdout* "$out"/stderr*; do [[ -f "$f" ]] && { echo "--- $f"; tail -n 40 "$f"; }; done
  exit 1
}

el_wait_for() {
  local file=$1 secs=$2 i
  for ((i = 0; i < secs * 10; ++i)); do
    [[ -e "$file" ]] && return 0
    kill -0 "$job" 2>/dev/null || el_fail "the run ended before $file appeared"
    sleep 0.1
  done
  el_fail "no $file after $secs s"
}

el_newest() {
  local d newest=
  for d in "$out"/ck/step-*; do [[ -f "$d/manifest.json" ]] && newest=$((10#${d##*step-})); done
  echo "$newest"
}

el_start_and_cut() {
  el_run "$@" >"$out/stdout" 2>"$out/stderr" &
  job=$!
  el_cut_after 20 60
}

el_cut_after() {
  el_wait_for "$out/ck/step-$(printf '%08d' "$1")/manifest.json" "$2"
  netns_link "$NET_ID" "$h1" down
  echo "took $h1's link down after checkpoint step $(el_newest)"
}

# Waits for $job and fails unless it exited 0.
el_wait_ok() {
  local rc=0
  wait "$job" || rc=$?
  [[ $rc -eq 0 ]] || el_fail "the elastic run exited with $rc"
}

el_same_as_manual() {
  local from=$1 workers=$2
  shift 2
  rm -rf "$out/manual"
  mkdir -p "$out/manual"
  cp -r "$out/ck/step-$(printf '%08d' "$from")" "$out/manual/"
  "$tandem" train -n "$workers" "${el_common[@]}" --checkpoint-dir "$out/manual" --resume --max-steps "${el_max_steps:-$steps}" \
    --metrics "$out/manual.jsonl" "$@" >"$out/stdout-manual" 2>&1 || el_fail "the manual --resume failed"
  el_compare_losses "$from" "$workers"
}

el_compare_losses() {
  python3 - "$(dirname "${BASH_SOURCE[0]}")" "$out" "$1" "$steps" "$2" "${3:-}" <<'PY' || el_fail "losses differ"
import json, sys
sys.path.insert(0, sys.argv[1])
from metrics import load
out, start, steps, workers, change = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
el, _ = load(f"{out}/elastic.jsonl")
man, _ = load(f"{out}/manual.jsonl")
want = steps - start
assert len(el) == want and len(man) == want, f"steps from {start}: elastic {len(el)}, manual {len(man)}, expected {want}"
worst = max(abs(a - b) for a, b in zip(el, man))
print(f"steps {start}-{steps}: worst per-step loss difference from a manual {workers}-worker --resume {worst:.2e}")
assert worst <= 1e-6, f"{worst:.2e} > 1e-6"
if change:  # OLD:NEW, the only membership change the metrics may record
    changes = [json.loads(l)["membership"] for l in open(f"{out}/elastic.jsonl") if "membership" in l]
    old, new = (int(x) for x in change.split(":"))
    assert len(changes) == 1 and (changes[0]["old_workers"], changes[0]["new_workers"]) == (old, new), changes
PY
}
