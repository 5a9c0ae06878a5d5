#!/usr/bin/env bash
# Bad input to `tandem train`: each case must exit non-zero, quickly, with a message that
# names the problem; fp16 convolutions on the CPU run with a warning. usage: train_bad_input.sh TANDEM
set -uo pipefail
tandem=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
expect() {  # expect NAME PATTERN -- command...
  local name=$1 pattern=$2; shift 3
  local start=$SECONDS
  timeout 120 "$@" >"$tmp/out" 2>&1
  local rc=$?
  if [ $rc -eq 0 ] || [ $rc -eq 124 ] || ! grep -qE -- "$pattern" "$tmp/out"; then
    echo "FAIL $name (exit $rc, $((SECONDS - start)) s); output:"; sed 's/^/    /' "$tmp/out" | tail -20
    fails=$((fails + 1))
  else
    echo "ok   $name (exit $rc, $((SECONDS - start)) s): $(grep -m1 -E -- "$pattern" "$tmp/out")"
  fi
}
expect missing-dataset "dataset directory '/nonexistent' not found.*apt-get install dataset-fashion-mnist" -- \
  "$tandem" train --data /nonexistent --no-baseline
expect uneven-batch "does not split evenly over 2 workers" -- "$tandem" train -n 2 --batch 127 --no-baseline
expect wrong-model "cannot train on an image dataset" -- "$tandem" train -n 1 --model transformer_tiny --max-steps 1
expect sp-mlp "--sequence-parallel needs a Llama model" -- "$tandem" train -n 2 --tp 2 --sequence-parallel --max-steps 1 \
  --no-baseline
expect unknown-model "unknown model .resnet9000. \\(known: mlp" -- "$tandem" train -n 1 --model resnet9000 --max-steps 1
expect unknown-strategy "unknown strategy 'zero9'" -- "$tandem" train -n 1 --strategy zero9 --max-steps 1
expect single-with-many "strategy single runs one worker" -- "$tandem" train -n 2 --strategy single
expect hsdp-bad-group "--shard-group 3 does not divide the 4 data-parallel ranks" -- \
  "$tandem" train -n 4 --strategy hsdp --shard-group 3 --max-steps 1 --no-baseline
expect shard-group-without-hsdp "--shard-group 2 applies to --strategy hsdp or hsdp2 only" -- \
  "$tandem" train -n 4 --strategy zero3 --shard-group 2 --max-steps 1 --no-baseline
expect unknown-flag "--frobnicate|not expected|extras" -- "$tandem" train --frobnicate
# Numbers out of range: the flag and the allowed range in plain words.
expect nprocs-zero "nprocs: must be between 1 and 4096, got 0$" -- "$tandem" train -n 0
expect nprocs-negative "nprocs: must be between 1 and 4096, got -3$" -- "$tandem" train -n -3
expect nprocs-not-a-number "nprocs: must be a whole number between 1 and 4096, got 'two'" -- "$tandem" train -n two
expect epochs-zero "epochs: must be between 1 and 10000, got 0$" -- "$tandem" train --epochs 0
expect batch-zero "batch: must be between 1 and 16777216, got 0$" -- "$tandem" train --batch 0
expect powersgd-rank-zero "powersgd-rank: must be between 1 and 1048576, got 0$" -- \
  "$tandem" train --compress powersgd --powersgd-rank 0
expect powersgd-rank-alone "--powersgd-rank and --powersgd-start-step apply to --compress powersgd" -- \
  "$tandem" train --powersgd-rank 4 --max-steps 1
expect powersgd-zero2 "--compress applies to --strategy ddp only" -- \
  "$tandem" train -n 2 --strategy zero2 --compress powersgd --max-steps 1 --no-baseline
expect compress-unknown "--compress must be none, bf16, fp16 or powersgd, not 'int8'" -- "$tandem" train --compress int8
expect bad-lr "lr must be a positive number" -- "$tandem" train -n 1 --lr -1 --max-steps 1
expect unknown-optimizer "unknown optimizer 'lion' \\(use sgd, adam, adamw, lars or lamb\\)" -- \
  "$tandem" train -n 1 --optimizer lion --max-steps 1
expect lars-trust-coefficient "LARS trust coefficient must be a positive number" -- \
  "$tandem" train -n 1 --optimizer lars --trust-coefficient 0 --max-steps 1
expect recompute-word "activation-checkpointing 'sometimes': use none, every, selective .*, or N" -- \
  "$tandem" train -n 1 --activation-checkpointing sometimes --max-steps 1
expect recompute-too-many "activation-checkpointing 40: the model has [0-9]+ layers; use at most" -- \
  "$tandem" train -n 1 --model mlp --activation-checkpointing 40 --max-steps 1
expect recompute-selective-mlp "selective recomputes .* this model \\(torch::nn::FlattenImpl, torch::nn::LinearImpl.*use --activation-checkpointing every or N" -- \
  "$tandem" train -n 1 --model mlp --activation-checkpointing selective --max-steps 1
expect async-without-every "checkpoint-async needs --checkpoint-every N" -- \
  "$tandem" train -n 1 --checkpoint-async --checkpoint-dir "$tmp/ck" --max-steps 1
expect grad-accum-zero "grad-accum must be at least 1" -- "$tandem" train -n 1 --grad-accum 0 --max-steps 1
expect grad-accum-pp "grad-accum with --pp: the pipeline already accumulates.*--micro-batches 8" -- \
  "$tandem" train -n 2 --pp 2 --grad-accum 2 --no-baseline --max-steps 1
expect grad-accum-shares "grad-accum with --batch-shares is not supported" -- \
  "$tandem" train -n 2 --batch-shares 3,1 --grad-accum 2 --no-baseline --max-steps 1
expect grad-accum-batch "gives each of the 2 data-parallel replicas 4 samples, fewer than --grad-accum 8" -- \
  "$tandem" train -n 2 --batch 8 --grad-accum 8 --no-baseline --max-steps 1

# A corrupt dataset: truncated image file, on 2 workers (the error must stop both, not hang).
mkdir -p "$tmp/corrupt"
for f in /usr/share/datasets/fashion-mnist/*; do cp "$f" "$tmp/corrupt/"; done
python3 - "$tmp/corrupt/train-images-idx3-ubyte.gz" <<'PY'
import gzip, sys
p = sys.argv[1]
data = gzip.open(p).read()
gzip.open(p, "wb").write(data[: len(data) // 3])
PY
expect truncated-file "train-images-idx3-ubyte.gz" -- "$tandem" train -n 2 --data "$tmp/corrupt" --no-baseline

# More workers than samples: a 3-sample IDX dataset on 4 workers.
mkdir -p "$tmp/tiny"
python3 - "$tmp/tiny" <<'PY'
import gzip, struct, sys
d = sys.argv[1]
for split, n in (("train", 3), ("t10k", 3)):
    with gzip.open(f"{d}/{split}-images-idx3-ubyte.gz", "wb") as f:
        f.write(struct.pack(">IIII", 0x803, n, 28, 28) + bytes(n * 784))
    with gzip.open(f"{d}/{split}-labels-idx1-ubyte.gz", "wb") as f:
        f.write(struct.pack(">II", 0x801, n) + bytes([1] * n))
PY
expect more-workers-than-samples "fewer than the 4 workers" -- "$tandem" train -n 4 --data "$tmp/tiny" --batch 4 --no-baseline

# Allowed but warned: fp16 convolutions on the CPU (no fast kernels); the MLP is not warned.
timeout 120 "$tandem" train -n 1 --model cnn --precision fp16 --batch 8 --max-steps 2 --no-eval --no-baseline \
  --no-progress >"$tmp/warn" 2>&1
rc=$?
if [ $rc -ne 0 ] || ! grep -q "warning: --precision fp16 on the CPU runs convolutions without fast kernels" "$tmp/warn"; then
  echo "FAIL fp16-cnn-warning (exit $rc)"; tail -5 "$tmp/warn"; fails=$((fails + 1))
else
  echo "ok   fp16-cnn-warning: $(grep -m1 warning "$tmp/warn")"
fi
timeout 120 "$tandem" train -n 1 --model mlp --precision fp16 --batch 8 --max-steps 2 --no-eval --no-baseline \
  --no-progress >"$tmp/warn" 2>&1
if grep -q "warning: --precision fp16" "$tmp/warn"; then echo "FAIL fp16-mlp-warned"; fails=$((fails + 1)); fi

echo "$fails failed"
[ $fails -eq 0 ]
