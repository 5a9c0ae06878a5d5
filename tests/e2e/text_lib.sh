# Sourced by the text e2e scripts after they set $data (the corpus): fails when the fortune corpus
# is not installed (scripts/setup.sh installs it: part of the test setup), makes $tmp (removed on
# exit) and sets fails=0. Then:
#   run NAME command...        runs it (timeout $run_timeout, default 240 s) with its output in
#                              $tmp/NAME.log; a non-zero exit is a failure (the log's tail shown)
#   field NAME LABEL           the first number after a report line "LABEL  ..." in $tmp/NAME.log
#   first_loss NAME            the loss of the first progress line ("step 1/N loss X")
#   check DESCRIPTION EXPR     a Python expression that must be true
#   num VALUE                  VALUE, or nan when empty (so a missing figure fails its check)
#   same_steps REF NAME TOL    NAME's per-step losses ($tmp/NAME.jsonl, from --metrics) are as
#                              many as REF's and each within TOL relative of REF's
if [ ! -d "$data/de" ]; then
  echo "FAIL: no fortune corpus at $data (apt-get install fortunes fortunes-de fortunes-es fortunes-it fortunes-pl fortunes-ru fortunes-cs; scripts/setup.sh does)"
  exit 1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
run() {
  local name=$1; shift
  local start=$SECONDS
  if ! timeout "${run_timeout:-240}" "$@" >"$tmp/$name.log" 2>&1; then
    echo "FAIL $name (exit non-zero after $((SECONDS - start)) s):"; tail -30 "$tmp/$name.log" | sed 's/^/    /'
    fails=$((fails + 1))
    return 1
  fi
  echo "ok   $name ($((SECONDS - start)) s)"
}
field() {
  grep -m1 -E "^$2 " "$tmp/$1.log" | sed -E "s/^$2 +([0-9.]+).*/\1/"
}
first_loss() {
  grep -m1 -E "step 1/[0-9]+ loss" "$tmp/$1.log" | sed -E 's/.*step 1\/[0-9]+ loss ([0-9.]+).*/\1/'
}
check() {
  if python3 -c "import sys; sys.exit(0 if ($2) else 1)" 2>/dev/null; then
    echo "ok   $1"
  else
    echo "FAIL $1"; fails=$((fails + 1))
  fi
}
num() { [ -n "$1" ] && echo "$1" || echo "nan"; }
same_steps() {
  local worst
  worst=$(python3 -c 'import json, sys
a, b = [[json.loads(l)["loss"] for l in open(f) if "\"step\"" in l] for f in sys.argv[1:]]
print(max(abs(x - y) / abs(x) for x, y in zip(a, b)) if len(a) == len(b) > 0 else "nan")' \
    "$tmp/$1.jsonl" "$tmp/$2.jsonl" 2>/dev/null)
  check "$1 and $2: every step's loss within $3 relative (worst $worst)" "float('$(num "$worst")') <= $3"
}
