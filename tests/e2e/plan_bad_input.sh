#!/usr/bin/env bash
# Impossible model or cluster descriptions to `tandem plan` (and bad input to `tandem bench`):
# each must exit non-zero, quickly, with a message naming the problem. usage: plan_bad_input.sh TANDEM
set -uo pipefail
tandem=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
fails=0
expect() {  # expect NAME PATTERN -- command...
  local name=$1 pattern=$2; shift 3
  timeout 60 "$@" >"$tmp/out" 2>&1
  local rc=$?
  if [ $rc -eq 0 ] || [ $rc -eq 124 ] || ! grep -qE -- "$pattern" "$tmp/out"; then
    echo "FAIL $name (exit $rc); output:"; sed 's/^/    /' "$tmp/out" | tail -20
    fails=$((fails + 1))
  else
    echo "ok   $name (exit $rc): $(grep -m1 -E -- "$pattern" "$tmp/out")"
  fi
}
expect unknown-model "unknown model 'resnet9000'.*built-in models: mlp" -- "$tandem" plan --model resnet9000
expect no-model "no model given" -- "$tandem" plan --cluster h100x8
expect heads-hidden "hidden size 1000 is not divisible by 16 heads" -- \
  "$tandem" plan --params 1e9 --layers 24 --hidden 1000 --heads 16 --seq 1024 --cluster h100x8
expect too-few-params "far fewer than" -- \
  "$tandem" plan --params 1e6 --layers 96 --hidden 12288 --heads 96 --seq 2048 --cluster h100x8
expect negative-params "parameters must be a positive number" -- "$tandem" plan --params -5 --hidden 64 --heads 4 --cluster h100x8
expect unknown-cluster "unknown cluster 'tpu-pod'" -- "$tandem" plan --model gpt2 --cluster tpu-pod
expect unknown-device "unknown device 'b300'" -- "$tandem" plan --model gpt2 --cluster h100x8 --device b300
expect zero-nodes "nodes must be at least 1, got 0" -- "$tandem" plan --model gpt2 --cluster h100-ib --nodes 0
expect zero-memory "memory must be positive" -- "$tandem" plan --model gpt2 --cluster h100x8 --memory-gb 0
expect bad-inter "inter-node bandwidth must be positive" -- "$tandem" plan --model gpt2 --cluster a100-ib --inter-gbps -1
expect bad-mfu "mfu. must be in \\(0, 1\\]" -- "$tandem" plan --model gpt2 --cluster h100x8 --mfu 1.5
expect bad-mixed "expected NODESxDEVICE" -- "$tandem" plan --model gpt2 --mixed h100
expect nothing-fits "no layout of llama-70b fits on h200x1" -- "$tandem" plan --model llama-70b --cluster h200x1
expect nothing-fits-why "out of memory: .* per device" -- "$tandem" plan --model llama-70b --cluster h200x1
expect bad-zero "ZeRO stages must be 0-3" -- "$tandem" plan --model gpt2 --cluster h100x8 --zero 4
expect cp-indivisible "context-parallel degree 3 does not divide the 8 devices" -- \
  "$tandem" plan --model gpt2 --cluster h100x8 --cp 3
expect ep-indivisible "expert-parallel degree 3 does not divide the 8 experts" -- \
  "$tandem" plan --model mixtral-8x7b --cluster h100-ib --ep 3
expect ep-dense "expert parallelism \\(ep 2\\) needs a MoE model; 'gpt2' has no experts" -- \
  "$tandem" plan --model gpt2 --cluster h100x8 --ep 2
expect ep-no-dp "expert-parallel degree 16 divides no .*data-parallel replicas" -- \
  "$tandem" plan --params 2e8 --layers 4 --hidden 512 --heads 8 --seq 128 --experts 16 --expert-intermediate 1024 \
  --cluster h100x8 --ep 16
expect top-k-beyond "top-k must be between 1 and the 8 experts, got 9" -- \
  "$tandem" plan --model mixtral-8x7b --cluster h100-ib --top-k 9
expect experts-on-preset "--experts and --expert-intermediate describe a custom MoE model" -- \
  "$tandem" plan --model llama-7b --cluster h100x8 --experts 8
expect moe-flag-dense "--top-k and --capacity-factor describe MoE blocks; 'gpt2' has none" -- \
  "$tandem" plan --model gpt2 --cluster h100x8 --capacity-factor 1.25
expect expert-width-missing "expert intermediate size must be at least 1, got 0" -- \
  "$tandem" plan --layers 4 --hidden 512 --heads 8 --seq 128 --experts 8 --cluster h100x8
mkdir -p qwen && printf '{"model_type": "qwen2_moe", "hidden_size": 64}\n' >qwen/config.json
expect hf-model-type "config.json: model_type 'qwen2_moe' is not one tandem plan reads" -- \
  "$tandem" plan --model qwen --cluster h100x8
expect hf-no-config "cannot read nonexistent.json" -- "$tandem" plan --model nonexistent.json --cluster h100x8
expect bad-workers "worker counts must be at least 1" -- "$tandem" plan --model cnn --cluster local --workers 0
expect calibrate-remote "--calibrate measures this machine" -- "$tandem" plan --model gpt2 --cluster h100x8 --calibrate
expect bench-uneven "does not split evenly over every worker count" -- "$tandem" bench --workers 2,3 --batch 128
expect bench-no-data "dataset directory '/nonexistent' not found" -- "$tandem" bench --data /nonexistent
expect bench-bad-layout "unknown entry 'tp2x'" -- "$tandem" bench --strategies ddp,tp2x
expect bench-micro-batches "does not split into --micro-batches 5" -- "$tandem" bench --workers 1,2 --batch 64 --strategies pp2 --micro-batches 5
expect calibrate-point-span "TANDEM_CALIBRATE_POINT_S='abc' is not a span in seconds" -- \
  env TANDEM_CALIBRATE_POINT_S=abc "$tandem" plan --cluster local --calibrate --calibrate-models mlp --model mlp \
  --calibration "$tmp/never.json"
expect calibrate-bad-model "--calibrate-models: 'resnet50' is not a model the calibration can run" -- "$tandem" plan --cluster local --calibrate --calibrate-models mlp,resnet50
expect bench-calibrate-predict "--predict-only predicts from an existing calibration" -- "$tandem" bench --calibrate --predict-only
expect bench-calibrate-model "--calibrate: the calibration runs the built-in models" -- "$tandem" bench --model transformer_tiny --calibrate
expect bench-unwritable-csv "cannot write the CSV '/nonexistent/b.csv'" -- "$tandem" bench --workers 1 --csv /nonexistent/b.csv
printf '{"cores": 2, "models": {"mlp": {"layer_overhead_s": [1, 2], "layer_s_per_sample": [1]}}}\n' > cal-bad.json
expect bench-bad-calibration "calibration file is not valid.*differ in length" -- "$tandem" bench --calibration cal-bad.json
echo "$fails failed"
[ $fails -eq 0 ]
