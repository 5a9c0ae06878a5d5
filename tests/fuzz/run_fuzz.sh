#!/usr/bin/env bash
# Bounded libFuzzer run (ctest fuzz_manifest, fuzz_idx):
#   run_fuzz.sh FUZZER SEED_DIR WORK_DIR [SECONDS] [DICT]
# Runs every committed seed first, then mutates for SECONDS (default 20). New inputs go to
# WORK_DIR/corpus, never into the source tree; a crashing input is written to WORK_DIR/crash-*
# (add it to SEED_DIR once fixed). Any crash, leak, timeout, out-of-memory or sanitizer report
# makes libFuzzer exit non-zero, and so the test fail.
set -euo pipefail
fuzzer=$1 seeds=$2 work=$3 secs=${4:-20} dict=${5:-}
n=$(find "$seeds" -type f | wc -l)
if [ "$n" -lt 1 ]; then
  echo "run_fuzz.sh: no seed inputs in $seeds" >&2
  exit 1
fi
mkdir -p "$work/corpus"
export ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
args=(-max_total_time="$secs" -rss_limit_mb=1024 -timeout=10 -print_final_stats=1 -artifact_prefix="$work/")
[ -n "$dict" ] && args+=(-dict="$dict")
echo "fuzzing $(basename "$fuzzer") for ${secs} s from $n seeds"
"$fuzzer" "${args[@]}" "$work/corpus" "$seeds"
