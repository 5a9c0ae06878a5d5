#!/usr/bin/env bash
# A network fault across hosts: a 2-host DDP run (network-namespace hosts, tests/netns) checkpoints
# every 20 steps; after its first checkpoint host 1's link is taken down. The job must end
# (non-zero) within 45 s, rank 0 naming rank 1 and its host as unreachable. With the link up
# again, relaunching with --resume must continue from the newest checkpoint and finish.
# usage: multinode_fault.sh TANDEM NET_ID   (exit 77: no netns here)
set -euo pipefail
tandem=$1
NET_ID=$2
id=$NET_ID
source "$(dirname "$0")/multinode_lib.sh"
h0="tdm$id-h0" h1="tdm$id-h1"
mn_hosts "$h0" "$h1"  # the job's processes all live in these hosts and go with them on exit
printf '%s slots=1\n' "$h0" "$h1" >"$out/hostfile"
steps=600
run() {
  mn_launch "$tandem" train -n 2 --hostfile "$out/hostfile" --net-if "$mn_net" \
    --strategy ddp --model mlp --optimizer adamw --lr 0.001 --batch 64 --seed 5 --max-steps "$steps" \
    --no-eval --no-baseline --no-progress --threads 1 --checkpoint-dir "$out/ck" --checkpoint-every 20 --timeout 8 "$@"
}

run >"$out/stdout1" 2>"$out/stderr1" &
job=$!
for _ in $(seq 1 600); do
  [[ -f "$out/ck/step-00000020/manifest.json" ]] && break
  kill -0 "$job" 2>/dev/null || { echo "FAIL: the run ended before its first checkpoint"; cat "$out/stdout1" "$out/stderr1"; exit 1; }
  sleep 0.1
done
[[ -f "$out/ck/step-00000020/manifest.json" ]] || { echo "FAIL: no checkpoint after 60 s"; cat "$out/stdout1" "$out/stderr1"; exit 1; }
t0=$(date +%s.%N)
netns_link "$id" "$h1" down
echo "took $h1's link down after $(find "$out/ck" -maxdepth 1 -name 'step-*' | wc -l) checkpoint(s)"
for _ in $(seq 1 450); do
  kill -0 "$job" 2>/dev/null || break
  sleep 0.1
done
kill -0 "$job" 2>/dev/null && { echo "FAIL: the job still runs 45 s after the link went down"; cat "$out/stdout1" "$out/stderr1"; exit 1; }
set +e
wait "$job"
rc=$?
set -e
elapsed=$(python3 -c "print(f'{$(date +%s.%N) - $t0:.1f}')")
echo "launcher exit code $rc, $elapsed s after the link went down"
grep -v "^\s*$" "$out/stderr1" | tail -n 6
[[ $rc -ne 0 ]] || { echo "FAIL: exit code 0 although a host was cut off"; exit 1; }
ip1=$(netns_ip "$id" "$h1" | sed 's/\./\\./g')
grep -Eq "rank 1 on host $h1 \($ip1\) is unreachable from rank 0 on host $h0" "$out/stderr1" ||
  { echo "FAIL: the unreachable rank and host are not named"; cat "$out/stderr1"; exit 1; }
newest=
for d in "$out"/ck/step-*; do  # in step order: the numbers are zero-padded
  if [[ -f "$d/manifest.json" ]]; then newest=$(basename "$d"); fi
done

# The link is back; whatever the cut-off host still runs is stopped, as an operator would.
netns_link "$id" "$h1" up
for h in "$h0" "$h1"; do
  for pid in $(ip netns pids "$h"); do kill -9 "$pid" 2>/dev/null || true; done
done
steps=$((10#${newest#step-} + 40))
run --resume >"$out/stdout2" 2>"$out/stderr2" ||
  { echo "FAIL: the resumed run failed"; cat "$out/stdout2" "$out/stderr2"; exit 1; }
grep -q "resuming from .*$newest" "$out/stdout2" ||
  { echo "FAIL: the relaunch did not resume from $newest"; cat "$out/stdout2"; exit 1; }
grep -q "^steps *$steps " "$out/stdout2" || { echo "FAIL: the resumed run did not reach step $steps"; cat "$out/stdout2"; exit 1; }
echo "resumed from $newest and finished at step $steps"
echo "network fault ok"
