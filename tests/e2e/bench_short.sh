#!/usr/bin/env bash
# A short `tandem bench` (MLP, 1 and 2 workers, 4 steps): the table, the CSV and, with gnuplot,
# the plot. usage: bench_short.sh TANDEM
set -euo pipefail
tandem=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
# Calibration points timed for 0.05 s instead of 0.3: this script checks what a calibration
# holds and how the bench uses it, not how steady its figures are (a minute saved).
export TANDEM_CALIBRATE_POINT_S=0.05
"$tandem" bench --model mlp --workers 1,2 --strategies ddp,zero1 --steps 4 --batch 64 --csv b.csv --plot b.png \
  --calibration none.json | tee out.txt
[ "$(wc -l < b.csv)" -eq 4 ] || { echo "expected a header and 3 rows in b.csv"; cat b.csv; exit 1; }
grep -q '^mlp,1,single,64,4,1,' b.csv
grep -q '^mlp,2,zero1,64,4,1,' b.csv
if command -v gnuplot >/dev/null; then
  [ -s b.png ] || { echo "gnuplot is installed but no plot was written"; exit 1; }
else
  grep -q "no plot: gnuplot is not installed" out.txt
fi

# Calibration (2 workers, small batch) and a bench of data- and model-parallel layouts that
# predicts every row from it.
"$tandem" plan --calibrate --calibrate-workers 2 --calibrate-batch 32 --model mlp --workers 1,2 --batch 64 \
  --calibration cal.json > plan.txt
python3 - cal.json <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
for m, kids in (("mlp", 6), ("cnn", 10), ("cnn_bn", 12)):
    r = c["models"][m]
    assert len(r["layer_overhead_s"]) == kids and len(r["layer_s_per_sample"]) == kids, (m, r)
    assert all(x >= 0 for x in r["layer_overhead_s"] + r["layer_s_per_sample"]), (m, r)
    assert sum(r["layer_s_per_sample"]) > 0, (m, r)
    assert r["flops_synchronized"]["2"] > 0 and r["flops_while_waiting"]["2"]["1"] > 0, (m, r)
    assert r["sync_point_s"]["2"] >= 0, (m, r)
assert c["p2p"]["2"]["alpha"] > 0 and c["p2p"]["2"]["bandwidth"] > 0, c["p2p"]
assert c["collectives"]["2"]["allreduce"]["bandwidth"] > 0
for op in ("reduce_scatter_shm", "allgather_shm"):
    assert len(c["collective_times"]["2"][op]) == 5 and all(t > 0 for _, t in c["collective_times"]["2"][op]), op
d = c["send_delay"]["2"]
assert [b for b, _ in d] == [4096, 196608, 1048576] and all(0 <= s <= 0.1 for _, s in d), d
print("calibration ok")
PY
"$tandem" plan --cluster local --devices 2 --model mlp --batch 64 --calibration cal.json > layouts.txt
for l in "dp1 tp2 pp1" "dp1 tp1 pp2"; do
  grep -q "$l" layouts.txt || { echo "the local plan of 2 workers lacks $l"; cat layouts.txt; exit 1; }
done
"$tandem" bench --model mlp --workers 1,2 --strategies ddp,tp2,pp2,pp2-gpipe --micro-batches 2 --steps 4 --batch 64 \
  --csv l.csv --no-plot --calibration cal.json | tee out2.txt
[ "$(wc -l < l.csv)" -eq 6 ] || { echo "expected a header and 5 rows in l.csv"; cat l.csv; exit 1; }
python3 - l.csv <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
assert [r["strategy"] for r in rows] == ["single", "ddp", "tp2", "pp2", "pp2-gpipe"], rows
for r in rows:
    assert float(r["predicted_ms"]) > 0 and float(r["step_ms"]) > 0, r
print("layout bench ok")
PY
# --predict-only: the same rows and predictions, nothing run; without a calibration, an error.
"$tandem" bench --model mlp --workers 1,2 --strategies ddp,tp2,pp2,pp2-gpipe --micro-batches 2 --batch 64 \
  --calibration cal.json --predict-only --data /nonexistent > pred.txt  # needs no dataset
python3 - l.csv pred.txt <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
pred = [l.split() for l in open(sys.argv[2]).read().splitlines()[1:]]
assert [(p[0], p[1]) for p in pred] == [(r["workers"], r["strategy"]) for r in rows], pred
for p, r in zip(pred, rows):
    assert abs(float(p[2]) - float(r["predicted_ms"])) <= 0.051, (p, r)
print("predict-only ok")
PY
# --grad-accum K: the layouts without a pipeline and the single worker run K micro-batches (each
# pass's intercept once per micro-batch), a pipeline keeps --micro-batches; the header names it.
for k in 1 2; do
  "$tandem" bench --model mlp --workers 1,2 --strategies ddp,zero1,pp2 --micro-batches 2 --batch 64 --grad-accum $k \
    --calibration cal.json --predict-only --data /nonexistent > "ga$k.txt"
done
python3 - ga1.txt ga2.txt <<'PY'
import sys
one, two = ({tuple(l.split()[:2]): float(l.split()[2]) for l in open(f).read().splitlines()[1:]} for f in sys.argv[1:])
for key in (("1", "single"), ("2", "ddp"), ("2", "zero1")):
    assert two[key] > one[key], (key, one[key], two[key])
assert two[("2", "pp2")] == one[("2", "pp2")], (one, two)
print("grad-accum predictions ok")
PY
"$tandem" bench --model mlp --workers 1,2 --strategies ddp --steps 3 --batch 64 --grad-accum 2 --csv g.csv --no-plot \
  --calibration cal.json | tee out4.txt
grep -q "gradient accumulation 2" out4.txt || { echo "the header does not name the accumulation"; exit 1; }
if "$tandem" bench --model mlp --workers 1,2 --batch 64 --grad-accum 3 --predict-only --calibration cal.json > ga3.txt 2>&1; then
  echo "--grad-accum 3 with --batch 64 succeeded"; exit 1
fi
grep -q "does not split into --grad-accum 3" ga3.txt || { cat ga3.txt; exit 1; }
if "$tandem" bench --model mlp --workers 1,2 --calibration missing.json --predict-only > np.txt 2>&1; then
  echo "--predict-only without a calibration succeeded"; exit 1
fi
grep -q "needs a calibration" np.txt || { cat np.txt; exit 1; }
# --calibrate: a calibration of this model alone before every repetition, each repetition's
# prediction kept, the median reported. --drift-warn 0: the single worker's spread over the
# repetitions is always reported (at the default 15 % only when the machine changed speed).
"$tandem" bench --model mlp --workers 1,2 --strategies ddp,pp2 --micro-batches 2 --steps 3 --batch 64 --reps 2 \
  --calibrate --csv k.csv --no-plot --drift-warn 0 | tee out3.txt
python3 - k.csv <<'PY'
import csv, json, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
assert [r["strategy"] for r in rows] == ["single", "ddp", "pp2"], rows
for r in rows:
    per = [float(x) for x in r["predicted_ms_per_rep"].split(";")]
    assert len(per) == 2 and all(p > 0 for p in per), r
    assert abs(statistics.median(per) - float(r["predicted_ms"])) <= 0.002, r
    steps = [float(x) for x in r["step_ms_per_rep"].split(";")]
    assert len(steps) == 2 and all(t > 0 for t in steps), r
    assert abs(statistics.median(steps) - float(r["step_ms"])) <= 0.002, r
    assert r["measurements"] == "2" and r["spread"] == "", r  # no spread from two measurements
for k in (1, 2):
    c = json.load(open(f"k.calibration-{k}.json"))
    assert list(c["models"]) == ["mlp"], list(c["models"])  # this model only
    assert c["models"]["mlp"]["flops_synchronized"]["2"] > 0 and c["collectives"]["2"]["allreduce"]["bandwidth"] > 0
print("calibrate per repetition ok")
PY
grep -q "\[2/2\] calibrating" out3.txt || { echo "no calibration before the second repetition"; exit 1; }
grep -q "note: the single worker's step varied by .* over the 2 repetitions" out3.txt ||
  { echo "no note of the single worker's spread with --drift-warn 0"; exit 1; }
if "$tandem" bench --model mlp --workers 1 --steps 1 --drift-warn -5 > dw.txt 2>&1; then
  echo "a negative --drift-warn was accepted"; exit 1
fi
grep -q "drift-warn" dw.txt || { echo "the refusal does not name --drift-warn"; cat dw.txt; exit 1; }
# --remeasure: rows whose median step sits --drift-warn % or more above their fastest measurement
# are measured again after the repetitions. At --drift-warn 0 every row qualifies (one more round
# each, every measurement kept in the median, the rows marked unsteady); at 1000 none does.
for dw in 0 1000; do
  [ $dw = 0 ] && w=1,2 || w=1
  "$tandem" bench --model mlp --workers $w --strategies ddp --steps 3 --batch 64 --reps 3 --remeasure 1 \
    --drift-warn $dw --csv r$dw.csv --no-plot --calibration none.json | tee r$dw.txt
done
python3 - r0.csv r1000.csv <<'PY'
import csv, statistics, sys
for path, n, names in ((sys.argv[1], 4, ["single", "ddp"]), (sys.argv[2], 3, ["single"])):
    rows = list(csv.DictReader(open(path)))
    assert [r["strategy"] for r in rows] == names, rows
    for r in rows:
        steps = [float(x) for x in r["step_ms_per_rep"].split(";")]
        assert int(r["measurements"]) == n == len(steps), (path, r)
        assert abs(statistics.median(steps) - float(r["step_ms"])) <= 0.002, r
        assert abs(statistics.median(steps) / min(steps) - 1 - float(r["spread"])) <= 0.0002, r
        assert r["steal_share"] == "" or 0 <= float(r["steal_share"]) <= 1, r
print("remeasure ok")
PY
[ "$(grep -c '\[+1/1\]' r0.txt)" -eq 2 ] || { echo "expected both rows measured again at --drift-warn 0"; exit 1; }
grep -q "note: unsteady (\*)" r0.txt || { echo "no note of the unsteady rows"; exit 1; }
if grep -q '\[+1/1\]\|note: unsteady' r1000.txt; then echo "rows measured again at --drift-warn 1000"; exit 1; fi
if "$tandem" bench --model mlp --workers 1 --steps 3 --remeasure -1 > rm.txt 2>&1; then
  echo "a negative --remeasure was accepted"; exit 1
fi
grep -q "remeasure" rm.txt || { echo "the refusal does not name --remeasure"; cat rm.txt; exit 1; }
echo "bench ok"
