#!/usr/bin/env bash
# Draws bench/large_batch_optim.sh's RESULTS (TSV) as a PNG with gnuplot: for each optimizer, the
# best test accuracy of its learning-rate sweep against the global batch (log scale), with the
# small-batch SGD reference as a horizontal line. Diverged runs count as missing.
# Usage: bench/large_batch_plot.sh large_batch.tsv OUT.png
set -euo pipefail
tsv=${1:?results TSV from bench/large_batch_optim.sh}
png=${2:?output PNG}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
ref=$(python3 - "$tsv" "$dir" <<'PY'
import csv, sys
best, ref = {}, None
for r in csv.DictReader(open(sys.argv[1]), delimiter="\t"):
    if r["accuracy"] == "diverged":
        continue
    acc, b = float(r["accuracy"]), int(r["batch"])
    if b == 128 and r["optimizer"] == "sgd":
        ref = acc
    key = (r["optimizer"], b)
    best[key] = max(best.get(key, 0.0), acc)
for opt in ("sgd", "lars", "lamb"):
    with open(f"{sys.argv[2]}/{opt}.dat", "w") as f:
        for (o, b), acc in sorted(best.items(), key=lambda kv: kv[0][1]):
            if o == opt:
                f.write(f"{b} {acc}\n")
print(ref if ref is not None else "NaN")
PY
)
gnuplot <<EOF
set terminal pngcairo size 720,440 font ",11"
set output "$png"
set title "CNN on Fashion-MNIST, 20 epochs: best test accuracy of each learning-rate sweep"
set xlabel "global batch"
set ylabel "test accuracy (%)"
set logscale x 2
set xrange [96:5500]
set xtics ("128" 128, "1024" 1024, "4096" 4096)
set key bottom left
set grid
plot $ref with lines dashtype 2 lc rgb "gray40" title "SGD at batch 128", \
     "$dir/sgd.dat" with linespoints pt 7 lw 2 title "SGD, linear scaling + warmup", \
     "$dir/lars.dat" with linespoints pt 5 lw 2 title "LARS", \
     "$dir/lamb.dat" with linespoints pt 9 lw 2 title "LAMB"
EOF
echo "wrote $png"
