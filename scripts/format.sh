#!/usr/bin/env bash
# Formats the C++ sources with clang-format and the repository's .clang-format.
# Usage: scripts/format.sh            format every tracked source file in place
#        scripts/format.sh --check    change nothing; list the files that are not formatted and
#                                     exit 1 if there are any (CI runs this)
# Files: the git-tracked *.h, *.cpp and *.cc under src include models tools tests examples bench.
#   CLANG_FORMAT   the clang-format to use (default: clang-format-14, else clang-format)
# Different clang-format releases format some constructs differently; CI uses Debian 12's
# clang-format 14 (installed by scripts/setup.sh), so another major version gets a warning.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=fix
case "${1:-}" in
  "") ;;
  --check) mode=check ;;
  -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "format.sh: unknown argument '$1' (usage: scripts/format.sh [--check])" >&2; exit 2 ;;
esac

cf=${CLANG_FORMAT:-}
if [ -z "$cf" ]; then
  for c in clang-format-14 clang-format; do
    if command -v "$c" >/dev/null 2>&1; then cf=$c; break; fi
  done
fi
if [ -z "$cf" ] || ! command -v "$cf" >/dev/null 2>&1; then
  echo "format.sh: clang-format not found; install it with scripts/setup.sh (Debian: apt-get install clang-format)" >&2
  exit 2
fi
major=$("$cf" --version | sed -n 's/.*version \([0-9][0-9]*\).*/\1/p' | head -n1)
if [ "$major" != "14" ]; then
  echo "format.sh: warning: $cf is version ${major:-unknown}; CI checks with clang-format 14, whose output may differ" >&2
fi

dirs=(src include models tools tests examples bench)
files=()
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  while IFS= read -r -d '' f; do
    case "$f" in *.h|*.cpp|*.cc) [ -f "$f" ] && files+=("$f") ;; esac
  done < <(git ls-files -z -- "${dirs[@]}")
else  # an unpacked archive without .git
  while IFS= read -r -d '' f; do files+=("${f#./}"); done \
    < <(find "${dirs[@]}" -type f \( -name '*.h' -o -name '*.cpp' -o -name '*.cc' \) -print0 2>/dev/null | sort -z)
fi
if [ ${#files[@]} -eq 0 ]; then
  echo "format.sh: no source files found" >&2
  exit 2
fi

if [ "$mode" = fix ]; then
  "$cf" --style=file -i "${files[@]}"
  echo "format.sh: formatted ${#files[@]} files with $cf"
  exit 0
fi

bad=()
for f in "${files[@]}"; do
  "$cf" --style=file --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ ${#bad[@]} -gt 0 ]; then
  echo "format.sh: ${#bad[@]} of ${#files[@]} files are not formatted:" >&2
  printf '  %s\n' "${bad[@]}" >&2
  echo "Run scripts/format.sh to format them." >&2
  exit 1
fi
echo "format.sh: all ${#files[@]} files are formatted"
