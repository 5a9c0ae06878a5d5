#!/usr/bin/env bash
# Bad input to elastic runs (`-n MIN:MAX`): each case must exit non-zero at once with a message
# naming the problem. usage: elastic_bad_input.sh TANDEM
set -uo pipefail
tandem=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf 'nodeA slots=2\nnodeB slots=1\n' >"$tmp/hostfile"
ck=(--checkpoint-dir "$tmp/ck" --checkpoint-every 10 --no-baseline --max-steps 1)
fails=0
expect() {  # expect NAME STDERR_PATTERN -- command...: a non-zero exit within 60 s, the pattern on stderr
  local name=$1 pattern=$2
  shift 3
  if "$(dirname "$0")/expect_run.sh" --exit nonzero --within 60 --stderr "$pattern" -- "$@" >"$tmp/report"; then
    echo "ok   $name: $(grep -m1 "^exit status" "$tmp/report")"
  else
    echo "FAIL $name"; sed 's/^/    /' "$tmp/report" | tail -20
    fails=$((fails + 1))
  fi
}
expect min-above-max "'3:2': MIN \(3\) is above MAX \(2\)" -- "$tandem" train -n 3:2 "${ck[@]}"
expect min-zero "'0:2': at least 1 worker is needed" -- "$tandem" train -n 0:2 "${ck[@]}"
expect not-a-range "'1:x': MAX 'x' is not a whole number" -- "$tandem" train -n 1:x "${ck[@]}"
expect min-workers-and-range "--min-workers 1 and -n 1:2 both give a minimum" -- \
  "$tandem" train -n 1:2 --min-workers 1 "${ck[@]}"
expect min-workers-above-n "'3:2': MIN \(3\) is above MAX \(2\)" -- "$tandem" train -n 2 --min-workers 3 "${ck[@]}"
expect no-checkpoints "-n 1:2 \(elastic\) relaunches from checkpoints: give --checkpoint-dir DIR and --checkpoint-every N" -- \
  "$tandem" train -n 1:2 --no-baseline --max-steps 1
expect no-checkpoint-every "give --checkpoint-dir DIR and --checkpoint-every N" -- \
  "$tandem" train -n 1:2 --checkpoint-dir "$tmp/ck" --no-baseline --max-steps 1
expect max-above-slots "MAX is above the 3 slot\(s\) of hostfile '$tmp/hostfile'" -- \
  "$tandem" train -n 2:4 --batch 64 --hostfile "$tmp/hostfile" "${ck[@]}"
expect no-count-fits "-n 4:5: no worker count from 4 to 5 can run this job \(at 5 workers: .*--batch 63.*; the global --batch 63 must split evenly" -- \
  "$tandem" train -n 4:5 --batch 63 "${ck[@]}"
expect scale-with-elastic-batch "--elastic-batch accumulate keeps the global batch \(--elastic-lr keep\)" -- \
  "$tandem" train -n 1:2 --elastic-lr scale --elastic-batch accumulate "${ck[@]}"
expect scale-not-whole "-n 2:3: no worker count from 2 to 3 can run this job.*--batch 64 must split evenly over the workers and scale to W/MAX of it" -- \
  "$tandem" train -n 2:3 --elastic-lr scale --batch 64 "${ck[@]}"
expect scale-with-shares "--elastic-lr scale with --batch-shares" -- \
  "$tandem" train -n 1:2 --elastic-lr scale --batch-shares 3,1 "${ck[@]}"
expect elastic-batch-unknown "elastic-batch.*sideways" -- "$tandem" train -n 1:2 --elastic-batch sideways "${ck[@]}"
expect text-elastic "-n 1:2 \(elastic\) relaunches from checkpoints: give --checkpoint-dir DIR and --checkpoint-every N" -- \
  "$tandem" pretrain -n 1:2 --out "$tmp/pt" --max-per-label 50
exit $((fails > 0))
