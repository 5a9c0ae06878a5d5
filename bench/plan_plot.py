#!/usr/bin/env python3
"""Draws `tandem plan`'s predicted step times against the measured ones from `tandem bench`
CSVs (made with --calibrate or --calibration, e.g. by bench/plan_accuracy.sh) as a PNG with
gnuplot: one point per row, the diagonal and the ±20 % band.

usage: bench/plan_plot.py OUT.png bench_mlp.csv [bench_cnn.csv ...]
"""
import csv, os, subprocess, sys, tempfile

def main():
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    out, files = sys.argv[1], sys.argv[2:]
    rows = []
    for f in files:
        for r in csv.DictReader(open(f)):
            if r.get("predicted_ms") and float(r["predicted_ms"]) > 0:
                rows.append((r["model"], float(r["step_ms"]), float(r["predicted_ms"])))
    if not rows:
        print("no row with a prediction in", files, "(run tandem bench with --calibrate)")
        return 1
    hi = max(max(m, p) for _, m, p in rows) * 1.15
    lo = min(min(m, p) for _, m, p in rows) / 1.15
    within = sum(abs(p - m) / m <= 0.2 for _, m, p in rows)
    with tempfile.TemporaryDirectory() as tmp:
        models = sorted({m for m, _, _ in rows})
        dat = os.path.join(tmp, "points.dat")
        with open(dat, "w") as f:
            for model in models:
                f.write(f"# {model}\n")
                for m, meas, pred in rows:
                    if m == model:
                        f.write(f"{meas} {pred}\n")
                f.write("\n\n")
        pts = ", ".join(f"'{dat}' index {i} using 1:2 title '{m}' with points pt 7 ps 1.2"
                        for i, m in enumerate(models))
        script = f"""set terminal pngcairo size 700,620 font ",11"
set output '{out}'
set title "tandem plan: predicted against measured step ({within} of {len(rows)} rows within 20 %)"
set xlabel 'measured step (ms)'
set ylabel 'predicted step (ms)'
set logscale xy
set xtics (10, 15, 20, 30, 50, 70, 100, 150, 200, 300)
set ytics (10, 15, 20, 30, 50, 70, 100, 150, 200, 300)
set xrange [{lo}:{hi}]
set yrange [{lo}:{hi}]
set key left top
set grid
plot x title 'exact' with lines lc rgb '#444444', 1.2*x title '±20 %' with lines dashtype 2 lc rgb '#999999', \\
     0.8*x notitle with lines dashtype 2 lc rgb "#999999", {pts}
"""
        subprocess.run(["gnuplot"], input=script, text=True, check=True)
    print(f"wrote {out}: {len(rows)} rows, {within} within 20 %")
    return 0

if __name__ == "__main__":
    sys.exit(main())
