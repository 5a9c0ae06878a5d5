#!/usr/bin/env bash
# Step time of 2 replica threads in one process (--replicas 2) against 2 worker processes
# (-n 2), DDP on the MLP and the CNN, the runs interleaved (procs, replicas, procs, ...) REPS
# times. Per run: the median step time after the first SKIP steps; then the median over the
# repetitions, and the ratio replicas / processes.
# usage: bench/replicas_step_time.sh [TANDEM] [STEPS] [REPS]
set -euo pipefail
tandem=${1:-build/tandem}
steps=${2:-60}
reps=${3:-3}
skip=10
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "2 workers (cores / 2 threads each), DDP, global batch 128, $steps steps, $reps reps, $(nproc) cores"
for rep in $(seq 1 "$reps"); do
  for model in mlp cnn; do
    for mode in procs replicas; do
      layout=(-n 2)
      [ "$mode" = replicas ] && layout=(--replicas 2)
      "$tandem" train "${layout[@]}" --model "$model" --batch 128 --seed 1 --max-steps "$steps" --no-eval \
        --no-baseline --no-progress --metrics "$out/$model-$mode-$rep.jsonl" >"$out/$model-$mode-$rep.log" 2>&1 ||
        { cat "$out/$model-$mode-$rep.log"; exit 1; }
    done
  done
done
python3 - "$out" "$reps" "$skip" <<'PY'
import json, statistics, sys
out, reps, skip = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def median_step(path):
    ms = [json.loads(l)["step_ms"] for l in open(path) if not json.loads(l).get("report")]
    return statistics.median(ms[skip:])
for model in ("mlp", "cnn"):
    med = {}
    for mode in ("procs", "replicas"):
        runs = [median_step(f"{out}/{model}-{mode}-{r}.jsonl") for r in range(1, reps + 1)]
        med[mode] = statistics.median(runs)
        print(f"{model} {mode:8s}: " + " ".join(f"{x:.2f}" for x in runs) + f" ms/step, median {med[mode]:.2f}")
    print(f"{model}: replicas / processes = {med['replicas'] / med['procs']:.3f}")
PY
