#!/usr/bin/env bash
# Elastic run below its minimum: `train -n 2:3` on hosts of 1 + 2 slots; host 1 (2 slots) is cut
# after the first checkpoint, leaving 1 slot, below MIN 2. The launcher must stop with a non-zero
# exit within 60 s, naming host 1 as lost.
# usage: elastic_below_min.sh TANDEM NET_ID   (exit 77: no netns here)
set -euo pipefail
tandem=$1
NET_ID=$2
el_batch=48  # 3 workers at first, then fewer
source "$(dirname "$0")/elastic_lib.sh"
printf '%s slots=1\n%s slots=2\n' "$h0" "$h1" >"$out/hostfile"

el_start_and_cut -n 2:3 --max-steps 100000
t0=$SECONDS
for _ in $(seq 1 600); do
  kill -0 "$job" 2>/dev/null || break
  sleep 0.1
done
kill -0 "$job" 2>/dev/null && el_fail "the launcher still runs 60 s after the cut"
set +e
wait "$job"
rc=$?
set -e
echo "exit code $rc, $((SECONDS - t0)) s after the cut"
[[ $rc -ne 0 ]] || el_fail "exit code 0 below the minimum"
grep -E "fit fewer than the minimum 2 worker\(s\); lost hosts: $h1 \(unreachable\)" "$out/stderr" ||
  el_fail "the message does not name the lost host"
echo "elastic below minimum ok"
