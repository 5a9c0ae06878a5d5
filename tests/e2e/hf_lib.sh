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
