# Sourced by the e2e_hf_* scripts with $src (the source tree) set: skips (exit 77) without
# .venv-hf or the fortunes corpus, makes $tmp (removed on exit) and the tiny random Llama
# directories of tests/hf/hf_fixture.py in $tmp/fx (lm, cls); $py is .venv-hf's python.
py=$src/.venv-hf/bin/python
[ -x "$py" ] || { echo "SKIP: $py missing (run scripts/setup-hf-venv.sh)"; exit 77; }
[ -d /usr/share/games/fortunes ] || { echo "SKIP: no fortunes corpus (apt-get install fortunes)"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
if ! "$py" "$src/tests/hf/hf_fixture.py" make "$tmp/fx" >"$tmp/fx.log" 2>&1; then
  echo "FAIL hf_fixture.py make:"; tail -20 "$tmp/fx.log"; exit 1
fi
