#!/usr/bin/env bash
# docs/CLI.md is what `tandem help --markdown` writes from the commands' own flag definitions
# (so a flag added without its line there fails here), and every command's --help lists the same
# flags as its section of docs/CLI.md, and the examples there and in README.md use only flags
# their command has; README.md links every command's section. The comparison is also run on a
# copy of the file with one flag's line taken out, which it must reject.
# Usage: cli_doc.sh TANDEM SOURCE_DIR
set -euo pipefail
tandem=$1
doc=$2/docs/CLI.md
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0

"$tandem" help --markdown >"$tmp/CLI.md"
if ! diff -u "$doc" "$tmp/CLI.md" >"$tmp/diff"; then
  cat "$tmp/diff"
  echo "FAIL: docs/CLI.md is not what the flags' definitions in tools/tandem/ give (diff above: - the file, + generated)."
  echo "      Regenerate it: scripts/cli-doc.sh   (builds tandem, then build/tandem help --markdown > docs/CLI.md)"
  fail=1
fi

# The commands: the "## tandem NAME" headings (a placeholder in capitals, DIR, becomes a value).
commands() { sed -n 's/^## tandem //p' "$1"; }

# The flags a section of DOC lists, one per line, sorted ("-n,--nprocs", "out").
doc_flags() {
  awk -v h="## tandem $2" '$0 == h { on = 1; next } /^## / { on = 0 }
    on && match($0, /^- `[^`]*`/) { s = substr($0, 4, RLENGTH - 4); gsub(/, /, ",", s); print s }' "$1" | sort
}

# The flags `tandem NAME --help` lists: the first word of each entry under "Options:" and
# "Positionals:" (entries are indented by two spaces, their wrapped descriptions by more),
# without -h,--help.
help_flags() {
  local words=()
  for w in $1; do
    if [[ $w =~ ^[A-Z_]+$ ]]; then words+=(x); else words+=("$w"); fi
  done
  "$tandem" "${words[@]}" --help | awk '/^[A-Za-z]+:$/ { on = ($0 == "Options:" || $0 == "Positionals:"); next }
    /^$/ { on = 0 } on && /^  [^ ]/ { print $1 }' | { grep -vx -- '-h,--help' || true; } | sort
}

# Compares every command's --help with DOC; prints each difference, returns 1 when there is one.
compare() {
  local bad=0 n=0
  while IFS= read -r cmd; do
    n=$((n + 1))
    help_flags "$cmd" >"$tmp/help.txt"
    doc_flags "$1" "$cmd" >"$tmp/doc.txt"
    if [ ! -s "$tmp/help.txt" ]; then
      echo "tandem $cmd --help lists no flags"
      bad=1
    elif ! diff "$tmp/help.txt" "$tmp/doc.txt" >"$tmp/flags.diff"; then
      echo "tandem $cmd: --help and docs/CLI.md list different flags (< --help only, > docs/CLI.md only):"
      grep '^[<>]' "$tmp/flags.diff"
      bad=1
    fi
  done < <(commands "$1")
  if [ "$n" -lt 10 ]; then
    echo "docs/CLI.md documents $n commands; tandem has at least 10"
    bad=1
  fi
  return $bad
}

# Every example in a bash block of FILE (docs/CLI.md, README.md) uses only flags its command
# documents; prints each unknown one, returns 1 when there is one.
check_examples() {
  local bad=0 line cmd flag
  while IFS= read -r line; do
    line=${line%% \#*}  # a trailing comment is prose
    read -ra w <<<"${line%% -- *}"
    cmd=${w[1]}
    [[ $cmd == finetune && " ${w[*]} " == *" --init-from "* ]] && cmd="finetune --init-from DIR"
    doc_flags "$doc" "$cmd" | tr ',' '\n' >"$tmp/known.txt"
    if [ ! -s "$tmp/known.txt" ]; then
      echo "$1: example of an undocumented command: $line"
      bad=1
      continue
    fi
    for flag in "${w[@]:2}"; do
      flag=${flag%%=*}
      if [[ $flag == -* ]] && ! grep -qx -- "$flag" "$tmp/known.txt"; then
        echo "$1: 'tandem $cmd' has no flag $flag: $line"
        bad=1
      fi
    done
  done < <(awk '/^```bash$/ { on = 1; next } /^```$/ { on = 0 }
    on { sub(/^\$ /, ""); if (/\\$/) { sub(/\\$/, ""); held = held $0; next } print held $0; held = "" }' "$1" |
    grep '^tandem ')
  return $bad
}
for f in "$doc" "$2/README.md"; do
  if ! check_examples "$f"; then
    echo "FAIL: an example in $f uses a flag its command does not have"
    fail=1
  fi
done

# README.md's table links every command's section (GitHub's anchor of "tandem NAME").
while IFS= read -r cmd; do
  a=$(printf 'tandem %s' "$cmd" | tr 'A-Z ' 'a-z-' | tr -cd 'a-z0-9_-')
  if ! grep -qF "(docs/CLI.md#$a)" "$2/README.md"; then
    echo "FAIL: README.md's command table has no link to docs/CLI.md#$a (tandem $cmd)"
    fail=1
  fi
done < <(commands "$doc")

if ! compare "$doc"; then
  echo "FAIL: docs/CLI.md does not match --help of every command; regenerate it: scripts/cli-doc.sh"
  fail=1
fi

# The comparison finds a flag whose line is missing.
awk '/^## tandem train$/ { on = 1 } /^## tandem launch$/ { on = 0 } !(on && /^- `--strategy`/)' "$doc" >"$tmp/cut.md"
if cmp -s "$doc" "$tmp/cut.md"; then
  echo "FAIL: tandem train's --strategy line not found in docs/CLI.md"
  fail=1
elif compare "$tmp/cut.md" >"$tmp/cut.out"; then
  echo "FAIL: the comparison accepted a docs/CLI.md without tandem train's --strategy"
  fail=1
elif ! grep -q -- '< --strategy' "$tmp/cut.out"; then
  cat "$tmp/cut.out"
  echo "FAIL: the comparison did not name the missing --strategy"
  fail=1
fi

[ "$fail" = 0 ] && echo "docs/CLI.md matches the flags' definitions and --help of all $(commands "$doc" | wc -l) commands"
exit "$fail"
