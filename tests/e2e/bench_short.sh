#!/usr/bin/env bash
# A short `tandem bench` (MLP, 1 and 2 workers, 4 steps): the table, the CSV and, with gnuplot,
# the plot. usage: bench_short.sh TANDEM
set -euo pipefail
tandem=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
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
echo "bench ok"
