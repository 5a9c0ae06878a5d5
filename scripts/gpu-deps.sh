#!/usr/bin/env bash
# Copies the header-only libraries Tandem builds with (nlohmann-json, CLI11) from this machine
# into .gpu-deps/include (git-ignored), for a GPU machine that has no apt: carry .gpu-deps
# along and scripts/gpu-check.sh picks it up.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu-deps/include
for d in /usr/include/nlohmann /usr/include/CLI; do
  [ -d "$d" ] || { echo "gpu-deps: $d missing; run scripts/setup.sh first" >&2; exit 1; }
  cp -r "$d" .gpu-deps/include/
done
grep -qx '/.gpu-deps/' .git/info/exclude 2>/dev/null || echo '/.gpu-deps/' >> .git/info/exclude
du -sh .gpu-deps
