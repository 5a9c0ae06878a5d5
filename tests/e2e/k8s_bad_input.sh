#!/usr/bin/env bash
# Bad values to `tandem k8s`: each must exit non-zero, quickly, with a message naming the flag
# and what to do, and write no manifest. usage: k8s_bad_input.sh TANDEM
set -uo pipefail
tandem=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
fails=0
img=registry.example.com/tandem:0.1
expect() {  # expect NAME PATTERN -- tandem k8s args...
  local name=$1 pattern=$2; shift 3
  rm -f "$tmp/job.yaml"
  timeout 30 "$tandem" k8s -o "$tmp/job.yaml" "$@" >"$tmp/out" 2>&1
  local rc=$?
  if [ $rc -eq 0 ] || [ $rc -eq 124 ] || ! grep -qE -- "$pattern" "$tmp/out" || [ -s "$tmp/job.yaml" ]; then
    echo "FAIL $name (exit $rc); output:"; sed 's/^/    /' "$tmp/out" | tail -20
    fails=$((fails + 1))
  else
    echo "ok   $name (exit $rc): $(grep -m1 -E -- "$pattern" "$tmp/out")"
  fi
}
expect zero-nodes "--nodes must be at least 1, got 0" -- --nodes 0 --image "$img"
expect negative-gpus "--gpus-per-node must be 0 \(a CPU job\) or more, got -1" -- --gpus-per-node -1 --image "$img"
expect no-image "--image is required" -- --nodes 2
expect upper-name "--name 'Fmnist': must be lower-case" -- --name Fmnist --image "$img"
expect digit-name "--name '1job': .*start with a letter" -- --name 1job --image "$img"
expect long-name "too long: the pod host name" -- --name "$(printf 'a%.0s' {1..60})" --image "$img"
expect bad-namespace "--namespace 'ML_team': not a valid namespace" -- --namespace ML_team --image "$img"
expect unknown-strategy "--strategy 'fsdp': unknown; use single, ddp, zero1, zero2, zero3, hsdp or hsdp2" -- --strategy fsdp --image "$img"
expect single-many "--strategy single runs one rank, but the layout has 2" -- --strategy single --nodes 2 --image "$img"
expect slots-not-dividing "--slots-per-worker 3 does not divide --gpus-per-node 8" -- \
  --gpus-per-node 8 --slots-per-worker 3 --image "$img"
expect pool-slots "does not divide pool a100's 4 GPUs per node" -- --image "$img" --slots-per-worker 8 \
  --pool h100:1:8:gpu=h100 --pool a100:1:4:gpu=a100
expect pool-form "--pool 'h100-8': expected NAME:NODES:GPUS" -- --pool h100-8 --image "$img"
expect pool-nodes "--pool h100: nodes must be at least 1, got 0" -- --pool h100:0:8:gpu=h100 --image "$img"
expect pool-selector "--pool b: a node selector is needed" -- --pool a:1:8:gpu=a --pool b:1:8 --image "$img"
expect pool-mixed-cpu "mixing GPU and CPU-only pools" -- --pool a:1:8:gpu=a --pool b:1:0:cpu=b --image "$img"
expect pool-and-nodes "--pool replaces --nodes and --gpus-per-node" -- --pool a:1:8:gpu=a --nodes 2 --image "$img"
expect bad-toleration "unknown effect 'NoWay'" -- --toleration nvidia.com/gpu:NoWay --image "$img"
expect bad-selector "--node-selector 'gpu': expected KEY=VALUE" -- --node-selector gpu --image "$img"
expect bad-label-value "not a valid label value" -- --node-selector "gpu=a b" --image "$img"
expect bad-pvc "--checkpoint-pvc 'My_Ckpt': not a valid claim name" -- --checkpoint-pvc My_Ckpt --image "$img"
expect size-without-pvc "--checkpoint-size needs --checkpoint-pvc" -- --checkpoint-size 10Gi --image "$img"
expect bad-size "--checkpoint-size 'ten': not a positive Kubernetes quantity" -- \
  --checkpoint-pvc c --checkpoint-size ten --image "$img"
expect bad-memory "--memory '64GB': not a positive Kubernetes quantity; write it like 64Gi" -- --memory 64GB --image "$img"
expect shm-over-memory "--shm-size 8Gi must be below --memory 4Gi" -- --shm-size 8Gi --memory 4Gi --image "$img"
expect bad-env "--env 'A-B=1': expected NAME=VALUE" -- --env A-B=1 --image "$img"
expect reserved-nprocs "training argument '-n' after --: the rank count is" -- --image "$img" -- -n 4
expect reserved-strategy "training argument '--strategy=zero1' after --: give it to tandem k8s" -- \
  --image "$img" -- --strategy=zero1
expect reserved-ckpt "training argument '--checkpoint-dir' after --: checkpoints go to the claim" -- \
  --image "$img" -- --checkpoint-dir /data
expect batch-split "the global batch 100 does not split over 3 data-parallel ranks; pass --batch with a multiple of 3" -- \
  --nodes 3 --image "$img" -- --batch 100
expect default-batch "the global batch 128 \(tandem train's default\) does not split over 24" -- \
  --nodes 3 --gpus-per-node 8 --image "$img"
expect shares-small "the global batch 16 is smaller than the 24 data-parallel ranks" -- \
  --nodes 3 --gpus-per-node 8 --image "$img" -- --batch 16 --batch-shares auto
expect tp-pp-split "16 ranks do not split into tp x pp x cp = 3 groups" -- \
  --nodes 2 --gpus-per-node 8 --image "$img" --checkpoint-pvc c -- --tp 3
expect tp-cp-split "16 ranks do not split into tp x pp x cp = 24 groups" -- \
  --nodes 2 --gpus-per-node 8 --image "$img" --checkpoint-pvc c -- --tp 2 --cp 4 --pp 3
expect bad-format "--format 'toml': use yaml or json" -- --format toml --image "$img"
echo "$fails failed"
[ $fails -eq 0 ]
