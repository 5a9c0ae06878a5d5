#!/usr/bin/env bash
# The main job's step time under two builds of tandem, interleaved (A B A B ...) so that the
# machine's slow and fast spells fall on both: `tandem train` with its defaults (the CNN on
# Fashion-MNIST, 2 workers, DDP) for STEPS steps, no evaluation, no one-worker baseline.
# Prints each run's median step and the ratio B/A of the medians over the repetitions.
#
# bench/ab_main_job.sh TANDEM_A TANDEM_B [REPS=5] [STEPS=150] [extra train flags...]
set -euo pipefail
a=$1 b=$2 reps=${3:-5} steps=${4:-150}
extra=("${@:5}")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
run() {  # BINARY LABEL REP
  "$1" train --max-steps "$steps" --no-eval --no-baseline --no-progress --metrics "$tmp/$2-$3.jsonl" "${extra[@]}" \
    > "$tmp/$2-$3.out" 2>&1 || { cat "$tmp/$2-$3.out"; exit 1; }
  python3 -c 'import json,sys; r=[json.loads(l) for l in open(sys.argv[1])][-1]; print("%.2f" % r["step_ms_median"])' \
    "$tmp/$2-$3.jsonl"
}
declare -a ma mb
for i in $(seq 1 "$reps"); do
  ma+=("$(run "$a" A "$i")")
  mb+=("$(run "$b" B "$i")")
  echo "rep $i: A ${ma[-1]} ms, B ${mb[-1]} ms"
done
python3 - "${ma[*]}" "${mb[*]}" <<'PY'
import statistics, sys
a = [float(x) for x in sys.argv[1].split()]
b = [float(x) for x in sys.argv[2].split()]
ma, mb = statistics.median(a), statistics.median(b)
ratios = [y / x for x, y in zip(a, b)]
print(f"median step: A {ma:.2f} ms, B {mb:.2f} ms; B/A {mb / ma:.3f} "
      f"(per-pair ratios {', '.join(f'{r:.3f}' for r in ratios)}; median {statistics.median(ratios):.3f})")
PY
