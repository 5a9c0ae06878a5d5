#!/usr/bin/env bash
# Measured pipeline bubble of plain 1F1B against interleaved 1F1B (v = 2, 4) on one model in one
# run: 2 ranks, pp 2, m = 4 and 8 (bench/bench_interleaved.cpp prints the table).
# Usage: bench/interleaved_bubble.sh [build dir] [bench_interleaved options...]
set -euo pipefail
build=${1:-build}
shift || true
here=$(cd "$(dirname "$0")/.." && pwd)
cmake --build "$build" --target bench_interleaved >/dev/null
"$here/scripts/mpirun-local.sh" -n 2 "$build/bench_interleaved" "$@"
