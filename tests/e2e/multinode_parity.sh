#!/usr/bin/env bash
# Multi-node parity: `tandem train --hostfile` across HOSTS network-namespace hosts with RANKS
# ranks each (tests/netns; mpirun in a third namespace starts the ranks through the rsh agent)
# gives the same per-step losses as the same world size on this one host (within 1e-5), `tandem
# launch` places ranks by slot with the right local ranks, and the training
# really talks TCP between distinct addresses:
#   - rank 0 reports HOSTS hosts with their own addresses, and the ranks on each;
#   - the hosts' network interfaces carried at least a quarter of the gradient bytes of every
#     step (a fallback to shared memory, which the hosts share, would move only kilobytes).
# usage: multinode_parity.sh TANDEM ddp|zero2|hsdp HOSTS RANKS_PER_HOST NET_ID   (exit 77: no netns here)
set -euo pipefail
tandem=$1
strategy=$2
nhosts=$3
per_host=$4
NET_ID=$5
id=$NET_ID
source "$(dirname "$0")/multinode_lib.sh"
hosts=()
for ((i = 0; i < nhosts; ++i)); do hosts+=("tdm$id-h$i"); done
mn_hosts "${hosts[@]}"
for h in "${hosts[@]}"; do echo "$h slots=$per_host"; done >"$out/hostfile"
n=$((nhosts * per_host))
steps=20
common=(--model mlp --strategy "$strategy" --batch 64 --seed 7 --lr 0.02 --schedule constant --max-steps "$steps"
        --no-eval --no-baseline --no-progress --threads 1 --timeout 60)

t0=$(date +%s.%N)
"$tandem" train -n "$n" "${common[@]}" --metrics "$out/one.jsonl" >"$out/one.log" 2>&1 ||
  { echo "FAIL: the one-host run failed"; cat "$out/one.log"; exit 1; }
t1=$(date +%s.%N)

# Bytes through a host's interface, both directions.
if_bytes() {
  ip netns exec "$1" sh -c 'echo $(( $(cat /sys/class/net/eth0/statistics/tx_bytes) + $(cat /sys/class/net/eth0/statistics/rx_bytes) ))'
}
before=$(if_bytes "${hosts[-1]}")
mn_launch "$tandem" train -n "$n" --hostfile "$out/hostfile" --net-if "$mn_net" "${common[@]}" \
  --metrics "$out/multi.jsonl" >"$out/multi.log" 2>&1 ||
  { echo "FAIL: the run across ${nhosts} hosts failed"; cat "$out/multi.log"; exit 1; }
t2=$(date +%s.%N)
after=$(if_bytes "${hosts[-1]}")
echo "one host: $(python3 -c "print(f'{$t1 - $t0:.1f}')") s; ${nhosts} hosts x ${per_host}: $(python3 -c "print(f'{$t2 - $t1:.1f}')") s"
grep "^hosts " "$out/multi.log" || true
grep "^throughput " "$out/multi.log" | sed "s/^/${nhosts} hosts x ${per_host}: /" || true

# `tandem launch` across the same hosts: ranks by slot, local ranks per host, output prefixed.
mn_launch "$tandem" launch -n "$n" --hostfile "$out/hostfile" --net-if "$mn_net" -- \
  sh -c 'echo "on $(hostname) local rank $OMPI_COMM_WORLD_LOCAL_RANK"' >"$out/launch.log" 2>&1 ||
  { echo "FAIL: tandem launch across ${nhosts} hosts failed"; cat "$out/launch.log"; exit 1; }
for ((r = 0; r < n; ++r)); do
  want="[rank $r] on tdm$id-h$((r / per_host)) local rank $((r % per_host))"
  grep -qxF "$want" "$out/launch.log" || { echo "FAIL: tandem launch: no line '$want'"; cat "$out/launch.log"; exit 1; }
done

# hsdp without --shard-group shards within each host: groups of the ranks per host across the
# hosts, one group of all ranks on this one host.
if [[ $strategy == hsdp* ]]; then
  grep -q "strategy $strategy (shard groups of $per_host)" "$out/multi.log" ||
    { echo "FAIL: across hosts $strategy's shard groups are not the $per_host ranks per host"; cat "$out/multi.log"; exit 1; }
  grep -q "strategy $strategy (shard groups of $n)" "$out/one.log" ||
    { echo "FAIL: on one host $strategy's shard group is not all $n ranks"; cat "$out/one.log"; exit 1; }
fi

# The layout rank 0 reports: every host with its own address and its ranks (by slot).
expect="hosts +${nhosts} hosts: "
for ((i = 0; i < nhosts; ++i)); do
  first=$((i * per_host))
  last=$((first + per_host - 1))
  ranks="rank $first"
  ((per_host > 1)) && ranks="ranks $first-$last"
  ((i > 0)) && expect+=", "
  expect+="tdm$id-h$i \\($(netns_ip "$id" "tdm$id-h$i" | sed 's/\./\\./g')\\) $ranks"
done
grep -Eq "^$expect\$" "$out/multi.log" || { echo "FAIL: no host layout line matching '$expect'"; cat "$out/multi.log"; exit 1; }

python3 - "$(dirname "$0")" "$out" "$steps" "$((after - before))" "${hosts[-1]}" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
from metrics import load
out, steps, moved, host = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
one, rep = load(f"{out}/one.jsonl")
multi, _ = load(f"{out}/multi.jsonl")
assert len(one) == steps and len(multi) == steps, f"steps: one host {len(one)}, several hosts {len(multi)}, expected {steps}"
worst = max(abs(a - b) for a, b in zip(one, multi))
print(f"worst per-step loss difference over {steps} steps: {worst:.2e} (losses {one[0]:.4f} -> {one[-1]:.4f})")
grad_bytes = 4 * rep["parameters"] * steps
print(f"{host}'s interface moved {moved / 2**20:.1f} MiB; the gradients of {steps} steps are {grad_bytes / 2**20:.1f} MiB")
ok = True
if worst > 1e-5:
    ok = False
    print(f"FAIL: losses across hosts differ from one host's by {worst:.2e} > 1e-5")
if moved < grad_bytes / 4:
    ok = False
    print("FAIL: too little traffic between the hosts: MPI did not use TCP between them")
print("multi-node parity " + ("holds" if ok else "FAILED"))
sys.exit(0 if ok else 1)
PY
