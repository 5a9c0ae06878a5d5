#!/usr/bin/env python3
"""Re-predicts `tandem bench --calibrate` runs with another build of `tandem`.

Each run directory holds what `tandem bench --model M ... --calibrate --csv DIR/bench_M.csv`
wrote, with its output saved as DIR/bench_M.log, as bench/plan_accuracy.sh does: bench_M.log
(every measurement), bench_M.calibration-K.json (the calibration taken before repetition K).
For every row, every calibration is re-predicted with `tandem bench --predict-only
--calibration FILE` and the median prediction compared with the median measured step. So a
change to the time model (src/plan/plan.cpp) can be tried on every row of every kept run in a
minute, without running anything.

With --by-config, one line per configuration (model, workers, layout) over all the runs given:
the median of the runs' errors, how many runs are within 20 %, and the range. A configuration
whose error changes sign from run to run misses by noise; one whose median is outside 20 % is
priced wrong.

usage: bench/reeval_predictions.py TANDEM DIR... [--verbose | --by-config]
  e.g. bench/reeval_predictions.py build/tandem build/plan-accuracy/* --by-config
"""
import glob
import os
import re
import statistics as st
import subprocess
import sys

STRATEGIES = "ddp,zero1,zero2,zero3,tp2,pp2,pp2-gpipe,tp2pp2,tp4,pp4"


def predictions(tandem, model, calibration, batch, partition, grad_accum):
    out = subprocess.run([tandem, "bench", "--model", model, "--workers", "1,2,3,4", "--strategies", STRATEGIES,
                          "--batch", str(batch), "--predict-only", "--calibration", calibration,
                          "--pp-partition", partition, "--grad-accum", str(grad_accum)],
                         capture_output=True, text=True, check=True).stdout
    got = {}
    for line in out.splitlines():
        f = line.split()
        if len(f) == 3 and f[0].isdigit() and f[2] != "-":
            got[(int(f[0]), f[1])] = float(f[2])
    return got


def rows_of(tandem, d):
    rows = []
    for log in sorted(glob.glob(os.path.join(d, "bench_*.log"))):
        model = re.search(r"bench_(\w+)\.log$", log).group(1)
        text = open(log).read()
        batch = int(re.search(r"global batch (\d+)", text).group(1))
        # The bench's header line names a pipeline cut other than by parameters, and gradient
        # accumulation; the predictions must use the same.
        header = re.search(r"^tandem bench: .*$", text, re.M)
        header = header.group(0) if header else ""
        cut = re.search(r"pipelines cut by (\S+)", header)
        partition = cut.group(1) if cut else "params"
        accum = re.search(r"gradient accumulation (\d+)", header)
        grad_accum = int(accum.group(1)) if accum else 1
        measured = {}
        for m in re.finditer(r"\[\+?(\d+)/\d+\] (\d+) worker\(s\), (\S+)\.\.\. ([0-9.]+) ms/step", text):
            measured.setdefault((int(m.group(2)), m.group(3)), []).append(float(m.group(4)))
        predicted = {}
        for cal in sorted(glob.glob(log[:-4] + ".calibration-*.json")):
            for key, v in predictions(tandem, model, cal, batch, partition, grad_accum).items():
                predicted.setdefault(key, []).append(v)
        for key, ms in measured.items():
            if key in predicted:
                meas, pred = st.median(ms), st.median(predicted[key])
                rows.append((d, model, key[0], key[1], meas, pred, (pred - meas) / meas))
    return rows


def main():
    args = [a for a in sys.argv[1:] if a not in ("--verbose", "--by-config")]
    if len(args) < 2:
        sys.exit(__doc__)
    tandem, dirs = args[0], args[1:]
    rows = [r for d in dirs for r in rows_of(tandem, d)]
    if not rows:
        sys.exit("no bench runs with calibrations found in " + " ".join(dirs))
    for d in dirs:
        rs = [r for r in rows if r[0] == d]
        if rs:
            print(f"{d}: {sum(abs(r[6]) <= 0.2 for r in rs)} of {len(rs)} within 20 %, "
                  f"{sum(abs(r[6]) <= 0.1 for r in rs)} within 10 %, mean abs {100 * st.mean(abs(r[6]) for r in rs):.1f} %")
    print(f"all: {sum(abs(r[6]) <= 0.2 for r in rows)} of {len(rows)} within 20 %, "
          f"{sum(abs(r[6]) <= 0.1 for r in rows)} within 10 %, mean abs {100 * st.mean(abs(r[6]) for r in rows):.1f} %")
    if "--by-config" in sys.argv:
        by = {}
        for r in rows:
            by.setdefault((r[1], r[2], r[3]), []).append(r[6])
        outside = 0
        for k in sorted(by):
            e = by[k]
            med = st.median(e)
            outside += abs(med) > 0.2
            print(f"  {k[0]:4s} {k[1]} {k[2]:10s} runs {len(e):2d}  median error {100 * med:+4.0f} %  "
                  f"within 20 %: {sum(abs(x) <= 0.2 for x in e)} of {len(e)}  range {100 * min(e):+.0f}..{100 * max(e):+.0f} %"
                  + ("  <- median outside 20 %" if abs(med) > 0.2 else ""))
        print(f"{len(by)} configurations, {len(by) - outside} with the median error within 20 %")
        return
    shown = sorted(rows, key=lambda r: (r[1], r[3], r[2], r[0])) if "--verbose" in sys.argv else \
        sorted(rows, key=lambda r: -abs(r[6]))[:10]
    for r in shown:
        print(f"  {os.path.basename(r[0]):8s} {r[1]:4s} {r[2]} {r[3]:10s} measured {r[4]:7.1f} predicted {r[5]:7.1f} {100 * r[6]:+5.0f} %")


if __name__ == "__main__":
    main()
