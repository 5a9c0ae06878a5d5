#!/usr/bin/env bash
# What asynchronous checkpoints and --trace cost a training run, in one interleaved run.
#   1. The stall per save: `tandem train` (MLP, CNN) and `tandem pretrain` (the text transformer
#      at its default shape) on 2 workers saving every 10 steps, synchronously and with
#      --checkpoint-async; "training held" is the time save() kept the loop waiting (rank 0).
#   2. The trace's overhead: the median step with and without --trace FILE, as a ratio.
# Variants alternate within each repetition; medians of the repetitions.
# usage: bench/checkpoint_trace.sh [TANDEM=build/tandem] [REPS=3]
set -euo pipefail
tandem=${1:-build/tandem}
reps=${2:-3}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
common=(-n 2 --no-eval --no-baseline --no-progress --threads 1 --batch 64)
held() { sed -n 's/.*training held \([0-9.]*\) ms per save.*/\1/p' "$1"; }
median_step() { sed -n 's/.*median step \([0-9.]*\) ms.*/\1/p' "$1"; }
for r in $(seq "$reps"); do
  for model in mlp cnn text; do
    for mode in sync async; do
      flags=(--checkpoint-every 10 --checkpoint-dir "$out/ck_${model}_${mode}_$r" --keep 1)
      [[ $mode == async ]] && flags+=(--checkpoint-async)
      if [[ $model == text ]]; then
        "$tandem" pretrain -n 2 --no-eval --no-progress --threads 1 --steps 60 --out "$out/pre" "${flags[@]}" \
          >"$out/log" 2>&1
      else
        "$tandem" train "${common[@]}" --model "$model" --max-steps 60 "${flags[@]}" >"$out/log" 2>&1
      fi
      echo "stall $model $mode $(held "$out/log") $(median_step "$out/log")" >>"$out/rows"
      rm -rf "$out/ck_${model}_${mode}_$r"
    done
  done
  for mode in plain trace; do
    flags=()
    [[ $mode == trace ]] && flags=(--trace "$out/t.json")
    "$tandem" train "${common[@]}" --model mlp --max-steps 150 "${flags[@]}" >"$out/log" 2>&1
    echo "trace mlp $mode - $(median_step "$out/log")" >>"$out/rows"
  done
done
python3 - "$out/rows" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
med = lambda xs: statistics.median(xs)
print("| model | saves | training held per save (ms) | median step (ms) |")
print("|---|---|---|---|")
for model in ("mlp", "cnn", "text"):
    for mode in ("sync", "async"):
        sel = [r for r in rows if r[0] == "stall" and r[1] == model and r[2] == mode]
        print(f"| {model} | {mode} | {med(float(r[3]) for r in sel):.1f} | {med(float(r[4]) for r in sel):.1f} |")
plain = [float(r[4]) for r in rows if r[0] == "trace" and r[2] == "plain"]
trace = [float(r[4]) for r in rows if r[0] == "trace" and r[2] == "trace"]
ratios = [t / p for p, t in zip(plain, trace)]
print(f"\n--trace: median step {med(trace):.2f} ms against {med(plain):.2f} ms without; "
      f"ratio per repetition {', '.join(f'{x:.3f}' for x in ratios)}, median {med(ratios):.3f}")
PY
