#!/usr/bin/env python3
"""How the bench's spread (median step / fastest measurement - 1) marks the misses of stored runs.

For every stored `tandem bench --calibrate` CSV with per-repetition steps: the rows, the rows whose
recorded prediction missed by more than 20 %, the rows with a spread of 15 % or more (the bench's
default --drift-warn, at which it now re-measures a row), and the misses among those. A miss with a
small spread was measured steadily: the time model's error. One with a large spread was measured
while the machine ran slow through most repetitions (docs/BENCHMARKS.md, "Eighteenth session").

usage: python3 bench/spread_of_runs.py DIR...
"""
import csv
import glob
import os
import statistics as st
import sys

if len(sys.argv) < 2:
    sys.exit(__doc__)
for d in sys.argv[1:]:
    for c in sorted(glob.glob(d + "/bench_*.csv")):
        rows = list(csv.DictReader(open(c)))
        if not rows or "step_ms_per_rep" not in rows[0]:
            continue
        out = []
        for r in rows:
            v = [float(x) for x in r["step_ms_per_rep"].split(";") if x]
            if len(v) < 3 or not r["prediction_error"]:
                continue
            out.append((st.median(v) / min(v), float(r["prediction_error"]), r["workers"] + "w " + r["strategy"]))
        if not out:
            continue
        miss = [o for o in out if abs(o[1]) > 0.2]
        hi = [o for o in out if o[0] >= 1.15]
        print(os.path.basename(d), os.path.basename(c), "rows", len(out), "misses", len(miss),
              "med/min>=1.15:", len(hi), "misses among them", sum(1 for o in hi if abs(o[1]) > 0.2),
              "max ratio %.2f" % max(o[0] for o in out))
        for o in miss:
            print("   miss %s err %+.0f%% med/min %.2f" % (o[2], 100 * o[1], o[0]))
