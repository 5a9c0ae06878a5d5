#!/usr/bin/env bash
# Elastic run, a host that comes back: `train -n 1:2` on 2 network-namespace hosts; after the
# first checkpoint host 1's link goes down; once the launcher has relaunched on host 0 alone, the
# link comes up again. At a later checkpoint the launcher must find host 1 answering, the worker
# must stop cleanly at its next checkpoint, and the job must finish on 2 workers from there; the
# report lists both changes (2 -> 1 losing host 1, 1 -> 2 regaining it). The last part's losses
# equal a manual 2-worker `--resume` from the checkpoint it started at (1e-6).
# usage: elastic_regrow.sh TANDEM NET_ID   (exit 77: no netns here)
set -euo pipefail
tandem=$1
NET_ID=$2
source "$(dirname "$0")/elastic_lib.sh"
steps=240

el_start_and_cut -n 1:2 --max-steps "$steps" --metrics "$out/elastic.jsonl"
for _ in $(seq 1 600); do
  grep -q "2 -> 1 workers" "$out/stdout" && break
  kill -0 "$job" 2>/dev/null || el_fail "the run ended before shrinking"
  sleep 0.1
done
grep -q "2 -> 1 workers" "$out/stdout" || el_fail "no shrink 60 s after the cut"
netns_link "$NET_ID" "$h1" up
echo "took $h1's link up again"
el_wait_ok
grep -E "elastic: after checkpoint step [0-9]+, $h1 answer\(s\) again; the workers stop at their next checkpoint" "$out/stdout" ||
  el_fail "the launcher did not see $h1 answer again"
grep -E "^stopping at step [0-9]+ \(checkpoint committed\)" "$out/stdout" || el_fail "the worker did not stop at a checkpoint"
grew=$(grep -oE "1 -> 2 workers \(hosts returned\); regained $h1; resuming from step [0-9]+" "$out/stdout" |
  head -n1 | grep -oE "[0-9]+$") || el_fail "no membership change 1 -> 2 regaining $h1"
grep -q "^steps *$steps " "$out/stdout" || el_fail "the run did not reach step $steps"
sed -n '/^membership changes/,$p' "$out/stdout"

el_same_as_manual "$grew" 2
echo "elastic regrow ok"
