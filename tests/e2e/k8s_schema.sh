#!/usr/bin/env bash
# `tandem k8s` manifests over a matrix of jobs (CPU, GPU, half-node workers, mixed pools, with
# and without a checkpoint claim, tolerations, JSON output) each validate against the MPIJob
# CRD schema and the checks of tests/e2e/k8s_validate.py, and honour the flags given; the YAML
# and JSON outputs are the same objects; broken copies of a manifest are rejected (so the
# validation can fail). usage: k8s_schema.sh TANDEM
set -uo pipefail
tandem=$1
here=$(cd "$(dirname "$0")" && pwd)
crd=$here/../data/k8s/mpijob-v2beta1-crd.yaml
py=/usr/bin/python3
if ! $py -c 'import jsonschema, yaml' 2>/dev/null; then
  echo "FAIL: $py lacks jsonschema/yaml (apt-get install python3-jsonschema python3-yaml; scripts/setup.sh does)"
  exit 1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
img=registry.example.com/tandem:0.1

case_() {  # case_ NAME "EXPECTATIONS" -- tandem k8s args...
  local name=$1 expect=$2; shift 3
  local out=$tmp/$name.yaml
  if ! "$tandem" k8s -o "$out" "$@" 2>"$tmp/$name.err"; then
    echo "FAIL $name: tandem k8s exited non-zero:"; sed 's/^/    /' "$tmp/$name.err"
    fails=$((fails + 1)); return
  fi
  local args=()
  for e in $expect; do args+=(--expect "$e"); done
  if $py "$here/k8s_validate.py" --crd "$crd" "$out" "${args[@]}" >"$tmp/$name.log" 2>&1; then
    echo "ok   $name: $(tail -1 "$tmp/$name.log") [$expect]"
  else
    echo "FAIL $name:"; sed 's/^/    /' "$tmp/$name.log"
    fails=$((fails + 1))
  fi
}

case_ cpu "name=cpu-job workers=2 slots=1 gpus=0 ranks=2 strategy=ddp pvc= claim=0 image=$img" -- \
  --name cpu-job --nodes 2 --image "$img" -- --model mlp --batch 64
case_ cpu-slots-pvc "workers=3 slots=2 gpus=0 ranks=6 pvc=shared-ckpt claim=0 namespace=ml" -- \
  --name cpu-slots --namespace ml --nodes 3 --slots-per-worker 2 --cpu 4 --memory 8Gi --image "$img" \
  --checkpoint-pvc shared-ckpt --env TANDEM_CHECK_COLLECTIVES=1 -- --batch 120
case_ gpu-claim "workers=2 slots=8 gpus=8 ranks=16 strategy=zero2 pvc=gpu-ckpt claim=1 tolerations=0" -- \
  --name gpu-job --nodes 2 --gpus-per-node 8 --image "$img" --strategy zero2 --checkpoint-pvc gpu-ckpt \
  --checkpoint-size 100Gi --storage-class nfs-client --cpu 96 --memory 1000Gi --shm-size 64Gi -- --batch 512
case_ gpu-half-nodes "workers=4 slots=4 gpus=4 ranks=16" -- \
  --name half --nodes 2 --gpus-per-node 8 --slots-per-worker 4 --image "$img" -- --batch 256
case_ mixed-pools "workers=7 slots=4 gpus=4 ranks=28 pools=2 tolerations=2 claim=1" -- \
  --name mixed --image "$img" \
  --pool h100:2:8:cloud.google.com/gke-accelerator=nvidia-h100-80gb \
  --pool a100:3:4:cloud.google.com/gke-accelerator=nvidia-tesla-a100,pool=a \
  --toleration nvidia.com/gpu:NoSchedule --toleration dedicated=ml:NoExecute \
  --node-selector kubernetes.io/arch=amd64 --checkpoint-pvc mixed-ckpt --checkpoint-size 50Gi \
  -- --batch 300 --batch-shares auto
# Tensor x pipeline parallel with ZeRO-3 over the data-parallel ranks, checkpointed on the claim
# and resumed from it on every start (tandem train checkpoints every layout).
case_ tp-pp-claim "workers=2 slots=8 gpus=8 ranks=16 strategy=zero3 tp=2 pp=2 resume=1 pvc=tp-ckpt claim=1" -- \
  --name tp-pp --nodes 2 --gpus-per-node 8 --image "$img" --strategy zero3 --checkpoint-pvc tp-ckpt \
  --checkpoint-size 20Gi -- --tp 2 --pp 2 --micro-batches 4 --batch 64
case_ single-gpu "workers=1 slots=1 gpus=1 ranks=1 strategy=single" -- \
  --name one --nodes 1 --gpus-per-node 1 --image "$img" --strategy single
case_ gpu-json "workers=2 slots=8 gpus=8 ranks=16 claim=1" -- \
  --name gpu-job --nodes 2 --gpus-per-node 8 --image "$img" --strategy zero2 --checkpoint-pvc gpu-ckpt \
  --checkpoint-size 100Gi --storage-class nfs-client --cpu 96 --memory 1000Gi --shm-size 64Gi --format json -- --batch 512

# The YAML emitter against a real YAML reader: the same objects as the JSON output.
if $py -c 'import json, sys, yaml
a = list(yaml.safe_load_all(open(sys.argv[1])))
b = json.load(open(sys.argv[2]))
b = b["items"] if b.get("kind") == "List" else [b]
sys.exit(0 if a == b else 1)' "$tmp/gpu-claim.yaml" "$tmp/gpu-json.yaml"; then
  echo "ok   yaml-equals-json: the YAML output reads back as the JSON output"
else
  echo "FAIL yaml-equals-json: the YAML and JSON outputs differ"; fails=$((fails + 1))
fi

# Negative controls: broken copies of a valid manifest (with a claim, no GPUs) must be rejected.
if $py "$here/k8s_validate.py" --crd "$crd" "$tmp/cpu-slots-pvc.yaml" --negative-controls >"$tmp/neg.log" 2>&1; then
  echo "ok   negative-controls: $(grep -c 'rejected as it must be' "$tmp/neg.log") broken manifests rejected"
else
  echo "FAIL negative-controls:"; sed 's/^/    /' "$tmp/neg.log"; fails=$((fails + 1))
fi
# And an expectation that does not hold must fail too.
if $py "$here/k8s_validate.py" --crd "$crd" "$tmp/cpu.yaml" --expect workers=3 >/dev/null 2>&1; then
  echo "FAIL expectation-control: a wrong --expect passed"; fails=$((fails + 1))
else
  echo "ok   expectation-control: a wrong --expect fails"
fi
echo "$fails failed"
[ $fails -eq 0 ]
