#!/usr/bin/env bash
# Measured pipeline bubble of plain 1F1B against interleaved 1F1B (v = 2, 4), zb-h1 and zb-v on one
# model in one run: NP ranks (2, the default, or 4), pp NP, m = 2 NP and 4 NP
# (bench/bench_interleaved.cpp prints the table, with pipeline_bubble_theory's figure).
# Usage: [NP=4] bench/interleaved_bubble.sh [build dir] [bench_interleaved options...]
set -euo pipefail
build=${1:-build}
shift || true
here=$(cd "$(dirname "$0")/.." && pwd)
cmake --build "$build" --target bench_interleaved >/dev/null
"$here/scripts/mpirun-local.sh" -n "${NP:-2}" "$build/bench_interleaved" "$@"
