#!/usr/bin/env bash
# How well `tandem plan` predicts step times on this machine, and the data behind the
# "Planning" section of docs/BENCHMARKS.md.
#
# For each model (the MLP and the CNN by default), `tandem bench --calibrate` runs every
# data-parallel, ZeRO, tensor- and pipeline-parallel layout of 1 to 4 workers (22 rows per
# model): before every repetition it calibrates this machine (`tandem plan --calibrate`, this
# model only) and predicts that repetition's rows from that calibration; each row's figure is
# the median over the repetitions, of the measurements and of the predictions alike. Rows the
# machine ran slow through are measured again (`--remeasure`, the bench's default). Then a
# summary: every row's measured and predicted step and error, and per model and in all the rows
# within 20 % and within 10 % and the mean absolute error.
#
# usage: bench/plan_accuracy.sh [TANDEM] [OUTDIR] [REPS] [MODELS]
#   TANDEM   the tandem binary (default build/tandem)
#   OUTDIR   where the runs go (default build/plan-accuracy/UTC-DATE-TIME; git-ignored)
#   REPS     repetitions, each with its own calibration (default 5)
#   MODELS   comma-separated (default mlp,cnn)
#
# About 15 minutes per model with 5 repetitions on a 2-core machine. Run it on a quiet machine:
# the calibrations and the runs share its cores with anything else running.
#
# OUTDIR keeps, per model M: bench_M.log (the bench's output, every measurement),
# bench_M.csv (its table), bench_M.calibration-K.json (the calibration taken before repetition
# K), and summary.md. bench/reeval_predictions.py TANDEM OUTDIR... re-predicts such directories
# with another build (a change to the time model, src/plan/plan.cpp) without running anything,
# and with --by-config gives each configuration's median error over several of them.
set -euo pipefail
tandem=${1:-build/tandem}
out=${2:-build/plan-accuracy/$(date -u +%Y%m%d-%H%M)}
reps=${3:-5}
models=${4:-mlp,cnn}
strategies=ddp,zero1,zero2,zero3,tp2,pp2,pp2-gpipe,tp2pp2,tp4,pp4

[ -x "$tandem" ] || { echo "plan_accuracy.sh: '$tandem' is not an executable; build Tandem first (scripts/setup.sh)" >&2; exit 2; }
case $reps in '' | *[!0-9]*) echo "plan_accuracy.sh: REPS must be a whole number, got '$reps'" >&2; exit 2 ;; esac
mkdir -p "$out"
{
  echo "date (UTC): $(date -u '+%Y-%m-%d %H:%M')"
  echo "commit: $(git -C "$(dirname "$0")" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "cpu: $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores"
  echo "command: tandem bench --model M --workers 1,2,3,4 --strategies $strategies --batch 192 --steps 30 --reps $reps --calibrate"
} > "$out/machine.txt"
cat "$out/machine.txt"

for m in ${models//,/ }; do
  "$tandem" bench --model "$m" --workers 1,2,3,4 --strategies "$strategies" --batch 192 --steps 30 \
    --reps "$reps" --calibrate --csv "$out/bench_$m.csv" --plot "$out/bench_$m.png" 2>&1 | tee "$out/bench_$m.log"
done

python3 - "$out" ${models//,/ } <<'PY' | tee "$out/summary.md"
import csv, os, statistics as st, sys

out, models = sys.argv[1], sys.argv[2:]
print(open(os.path.join(out, "machine.txt")).read().rstrip().replace("\n", "  \n"))
print()
print("| model | workers | layout | measured ms | predicted ms | error | spread |")
print("|---|---:|---|---:|---:|---:|---:|")
errors = {}
for m in models:
    for r in csv.DictReader(open(os.path.join(out, f"bench_{m}.csv"))):
        if not r["predicted_ms"]:
            continue
        e = float(r["prediction_error"])
        errors.setdefault(m, []).append(e)
        spread = f'{100 * float(r["spread"]):.0f} %' if r.get("spread") else "-"
        print(f'| {m} | {r["workers"]} | {r["strategy"]} | {float(r["step_ms"]):.1f} | '
              f'{float(r["predicted_ms"]):.1f} | {100 * e:+.1f} % | {spread} |')
print()


def line(name, es):
    return (f"{name}: {sum(abs(e) <= 0.2 for e in es)} of {len(es)} rows within 20 %, "
            f"{sum(abs(e) <= 0.1 for e in es)} within 10 %, mean absolute error {100 * st.mean(abs(e) for e in es):.1f} %")


for m, es in errors.items():
    print(line(m, es) + "  ")
every = [e for es in errors.values() for e in es]
if every:
    print(line("all", every))
PY
