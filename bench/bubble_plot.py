#!/usr/bin/env python3
"""Draws the pipeline bubble table that bench/interleaved_bubble.sh prints (bench_interleaved's
markdown) as a PNG with gnuplot: for each schedule and micro-batch count, the measured bubble
(idle over compute, mean over stages) beside the theory (p-1)/m or (p-1)/(m·v).

usage: bench/interleaved_bubble.sh build [options] | tee bubble.md; bench/bubble_plot.py bubble.md OUT.png
"""
import os, subprocess, sys, tempfile

def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    rows = []
    for line in open(sys.argv[1]):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[0] in ("1f1b", "interleaved"):
            schedule, m, v, mean, theory = cells[0], int(cells[1]), int(cells[2]), float(cells[6]), cells[7]
            rows.append((f"{'1F1B' if schedule == '1f1b' else 'interleaved'} m={m} v={v}", mean,
                         float(theory.split()[0])))
    if not rows:
        print("no bubble rows in", sys.argv[1])
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        dat = os.path.join(tmp, "bubble.dat")
        with open(dat, "w") as f:
            for label, mean, theory in rows:
                f.write(f'"{label}" {mean} {theory}\n')
        script = f"""set terminal pngcairo size 900,480 font ",11"
set output '{sys.argv[2]}'
set title 'Pipeline bubble on 2 ranks: measured (idle / compute, mean over stages) and theory'
set style data histogram
set style histogram clustered gap 1
set style fill solid 0.85 noborder
set ylabel 'idle / compute'
set xtics rotate by -25
set key left top
set grid ytics
set yrange [0:*]
plot '{dat}' using 2:xtic(1) title 'measured' lc rgb '#dd8452', '' using 3 title 'theory' lc rgb '#4c72b0'
"""
        subprocess.run(["gnuplot"], input=script, text=True, check=True)
    print(f"wrote {sys.argv[2]}: {len(rows)} rows")
    return 0

if __name__ == "__main__":
    sys.exit(main())
