#!/usr/bin/env bash
# Runs a command and checks how it ended: exit status, time taken, and lines of its output.
#
#   expect_run.sh [--exit 0|nonzero|N] [--within SECONDS] [--stdout ERE]... [--stderr ERE]...
#                 [--no-stdout ERE]... [--no-stderr ERE]... -- COMMAND ARGS...
#
# --within: the command must end within SECONDS (an integer) (it is killed 5 s later, so a hang fails
# here rather than at the ctest timeout). --stdout/--stderr: some line matches the extended
# regular expression; --no-*: no line does. Prints both streams when a check fails.
set -uo pipefail

exit_expect=0 within=0
declare -a out_re=() err_re=() no_out_re=() no_err_re=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --exit) exit_expect="$2"; shift 2 ;;
    --within) within="$2"; shift 2 ;;
    --stdout) out_re+=("$2"); shift 2 ;;
    --stderr) err_re+=("$2"); shift 2 ;;
    --no-stdout) no_out_re+=("$2"); shift 2 ;;
    --no-stderr) no_err_re+=("$2"); shift 2 ;;
    --) shift; break ;;
    *) echo "expect_run.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
[[ $# -gt 0 ]] || { echo "expect_run.sh: no command given" >&2; exit 2; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
start_ms=$(( $(date +%s%N) / 1000000 ))
if [[ "$within" != 0 ]]; then
  timeout --kill-after=5 "$((within + 5))" "$@" >"$tmp/out" 2>"$tmp/err"
else
  "$@" >"$tmp/out" 2>"$tmp/err"
fi
rc=$?
elapsed_ms=$(( $(date +%s%N) / 1000000 - start_ms ))
elapsed=$(printf "%d.%03d" $((elapsed_ms / 1000)) $((elapsed_ms % 1000)))

fail=0
problem() { echo "FAILED CHECK: $*"; fail=1; }
case "$exit_expect" in
  nonzero) [[ $rc -ne 0 ]] || problem "expected a non-zero exit status, got 0" ;;
  *) [[ $rc -eq $exit_expect ]] || problem "expected exit status $exit_expect, got $rc" ;;
esac
if [[ "$within" != 0 ]] && (( elapsed_ms > within * 1000 )); then
  problem "took ${elapsed} s, more than ${within} s"
fi
for re in ${out_re[@]+"${out_re[@]}"}; do grep -qE -- "$re" "$tmp/out" || problem "no stdout line matches /$re/"; done
for re in ${err_re[@]+"${err_re[@]}"}; do grep -qE -- "$re" "$tmp/err" || problem "no stderr line matches /$re/"; done
for re in ${no_out_re[@]+"${no_out_re[@]}"}; do ! grep -qE -- "$re" "$tmp/out" || problem "a stdout line matches /$re/"; done
for re in ${no_err_re[@]+"${no_err_re[@]}"}; do ! grep -qE -- "$re" "$tmp/err" || problem "a stderr line matches /$re/"; done

echo "command: $*"
echo "exit status $rc after ${elapsed} s"
if [[ $fail -ne 0 ]]; then
  echo "---- stdout"; cat "$tmp/out"
  echo "---- stderr"; cat "$tmp/err"
  exit 1
fi
echo "all checks passed"
