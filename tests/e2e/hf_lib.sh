# Sourced by the e2e_hf_* scripts with $src (the source tree) set: fails without .venv-hf or
# the fortunes corpus (both are part of the test setup: scripts/setup.sh, scripts/setup-hf-venv.sh),
# makes $tmp (removed on exit) and the tiny random Llama directories of tests/hf/hf_fixture.py in
# $tmp/fx (lm, cls); $py is .venv-hf's python.
py=$src/.venv-hf/bin/python
[ -x "$py" ] || { echo "FAIL: $py missing (run scripts/setup-hf-venv.sh)"; exit 1; }
[ -d /usr/share/games/fortunes ] || { echo "FAIL: no fortunes corpus (apt-get install fortunes)"; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
if ! "$py" "$src/tests/hf/hf_fixture.py" make "$tmp/fx" >"$tmp/fx.log" 2>&1; then
  echo "FAIL hf_fixture.py make:"; tail -20 "$tmp/fx.log"; exit 1
fi
# fortunes_jsonl OUT N: the first N fortune cookies (in file order) as {"text"} JSON lines.
fortunes_jsonl() {
  "$py" - "$1" "$2" <<'PY'
import json, os, sys
root, out, n = "/usr/share/games/fortunes", sys.argv[1], int(sys.argv[2])
docs = []
for name in sorted(os.listdir(root)):
    p = os.path.join(root, name)
    if os.path.isfile(p) and not os.path.islink(p) and not name.endswith((".dat", ".u8")):
        docs += [d.strip() for d in open(p, encoding="utf-8", errors="replace").read().split("\n%\n") if d.strip()]
    if len(docs) >= n:
        break
with open(out, "w") as f:
    for d in docs[:n]:
        f.write(json.dumps({"text": d}) + "\n")
PY
}
# classify_jsonl IN OUT: IN's texts with a label by length (negative, neutral, positive), for --task classify.
classify_jsonl() {
  "$py" - "$1" "$2" <<'PY'
import json, sys
labels = ["negative", "neutral", "positive"]
with open(sys.argv[1]) as f, open(sys.argv[2], "w") as g:
    for line in f:
        d = json.loads(line)["text"]
        g.write(json.dumps({"text": d, "label": labels[(len(d) > 80) + (len(d) > 250)]}) + "\n")
PY
}
# run NAME ARGS...: one `tandem finetune` run ($tandem), its metrics in $tmp/NAME.jsonl; a failure
# counts in $fails. same REF NAME [FROM [DROP]]: NAME's 20 losses (from step FROM on) equal REF's
# within 1e-4, and REF's fell by more than DROP (-1e9: no check).
run() {
  local name=$1; shift
  local start=$SECONDS
  if ! timeout 300 "$tandem" finetune "$@" --metrics "$tmp/$name.jsonl" --no-progress --threads 1 >"$tmp/$name.log" 2>&1; then
    echo "FAIL $name: exit non-zero; output:"; tail -20 "$tmp/$name.log"; fails=$((fails + 1)); return 1
  fi
  echo "ran  $name ($((SECONDS - start)) s)"
}
same() {
  "$py" - "$src/tests/e2e" "$tmp/$1.jsonl" "$tmp/$2.jsonl" "${3:-1}" "${4:-0.05}" <<'PY' || fails=$((fails + 1))
import sys
sys.path.insert(0, sys.argv[1])
import metrics
ref, _ = metrics.load(sys.argv[2])
got, _ = metrics.load(sys.argv[3])
first, drop = int(sys.argv[4]), float(sys.argv[5])
want = ref[first - 1:]
diff = max(abs(a - b) for a, b in zip(want, got)) if len(got) == len(want) else float("inf")
name = sys.argv[3].rsplit("/", 1)[1]
ok = len(want) == 20 - first + 1 and diff <= 1e-4 and (first != 1 or want[0] - want[-1] > drop)
print(f"{'ok  ' if ok else 'FAIL'} {name}: {len(got)} steps from step {first}, max |loss - one worker's| {diff:.2g}"
      f" (one worker: {want[0]:.4f} -> {want[-1]:.4f})")
sys.exit(0 if ok else 1)
PY
}
# near REF NAME TOL: NAME's 20 losses within TOL relative of REF's at every step, and falling.
near() {
  "$py" - "$src/tests/e2e" "$tmp/$1.jsonl" "$tmp/$2.jsonl" "$3" <<'PY' || fails=$((fails + 1))
import sys
sys.path.insert(0, sys.argv[1])
import metrics
ref, _ = metrics.load(sys.argv[2])
got, _ = metrics.load(sys.argv[3])
tol = float(sys.argv[4])
worst = max(abs(a - b) / abs(a) for a, b in zip(ref, got)) if len(got) == len(ref) else float("inf")
name = sys.argv[3].rsplit("/", 1)[1]
ok = len(got) == 20 and worst <= tol and got[0] - got[-1] > 0.05
print(f"{'ok  ' if ok else 'FAIL'} {name}: {len(got)} steps, max |loss - fp32's| / fp32's {worst:.2g} (bound {tol:g};"
      f" {got[0]:.4f} -> {got[-1]:.4f})")
sys.exit(0 if ok else 1)
PY
}
# refused NAME PATTERN COMMAND...: COMMAND exits non-zero and its output holds PATTERN; a failure
# counts in $fails.
refused() {
  local name=$1 pattern=$2; shift 2
  if timeout 120 "$@" >"$tmp/$name.log" 2>&1; then
    echo "FAIL $name: accepted"; fails=$((fails + 1))
  elif ! grep -qF -- "$pattern" "$tmp/$name.log"; then
    echo "FAIL $name: no '$pattern' in:"; tail -5 "$tmp/$name.log"; fails=$((fails + 1))
  else
    echo "ok   $name: $(grep -F -- "$pattern" "$tmp/$name.log" | head -1 | cut -c1-220)"
  fi
}
