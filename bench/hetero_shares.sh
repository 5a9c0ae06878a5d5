#!/usr/bin/env bash
# Heterogeneous batch shares: 2 workers, rank 1 slowed with --slow-rank (a delay per sample of
# its share, i.e. a slower device); step time with equal shares against --batch-shares auto,
# the two runs alternating, REPS repetitions each. Per run: the median step time over the
# steps after the first SKIP (warm-up, and the auto run's 8 equal-share calibration steps);
# then the median over the repetitions. Also prints the shares and the per-rank samples/s.
# usage: bench/hetero_shares.sh [TANDEM] [MODEL] [SLOW R:MS] [STEPS] [REPS]
set -euo pipefail
tandem=${1:-build/tandem}
model=${2:-cnn}
slow=${3:-1:1}
steps=${4:-60}
reps=${5:-3}
skip=10
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
common=(train -n 2 --model "$model" --batch 128 --seed 1 --max-steps "$steps" --no-eval --no-baseline --no-progress
  --threads 1 --slow-rank "$slow")
echo "model $model, 2 workers x 1 thread, global batch 128, --slow-rank $slow, $steps steps, $reps reps, $(nproc) cores"
for rep in $(seq 1 "$reps"); do
  for mode in equal auto; do
    extra=()
    [ "$mode" = auto ] && extra=(--batch-shares auto)
    "$tandem" "${common[@]}" "${extra[@]}" --metrics "$out/$mode-$rep.jsonl" >"$out/$mode-$rep.log" 2>&1 ||
      { cat "$out/$mode-$rep.log"; exit 1; }
  done
done
python3 - "$out" "$reps" "$skip" <<'PY'
import json, statistics, sys
out, reps, skip = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rows = {}
for mode in ("equal", "auto"):
    meds, last = [], None
    for rep in range(1, reps + 1):
        ms = []
        for line in open(f"{out}/{mode}-{rep}.jsonl"):
            d = json.loads(line)
            if d.get("report"): last = d
            elif d["step"] > skip: ms.append(d["step_ms"])
        meds.append(statistics.median(ms))
    rows[mode] = (meds, last)
print(f"| shares | median step ms per rep | median | samples/s | shares (rank 0/1) | per-rank samples/s (forward) |")
print("|---|---|---|---|---|---|")
for mode, (meds, r) in rows.items():
    m = statistics.median(meds)
    per = ", ".join(f"{a:.0f} ({f:.0f})" for a, f in zip(r["rank_samples_per_second"], r["rank_forward_samples_per_second"]))
    print(f"| {mode} | {', '.join(f'{x:.1f}' for x in meds)} | {m:.1f} | {128 * 1000 / m:.0f} | "
          f"{'/'.join(map(str, r['batch_shares']))} | {per} |")
e, a = statistics.median(rows["equal"][0]), statistics.median(rows["auto"][0])
print(f"auto shares: step time {a / e:.2f}x of equal shares ({e / a:.2f}x the throughput)")
PY
