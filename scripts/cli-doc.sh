#!/usr/bin/env bash
# Rewrites docs/CLI.md, the reference of every `tandem` command and flag, from the flags'
# definitions in tools/tandem/ (`tandem help --markdown`); run it after adding or changing a
# command or a flag (the test e2e_cli_doc fails until then).
# Usage: scripts/cli-doc.sh [BUILD_DIR]   (default: build; builds the tandem program there first)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
if [ ! -f "$build/build.ninja" ] && [ ! -f "$build/Makefile" ]; then
  echo "cli-doc.sh: no configured build in '$build'; run scripts/setup.sh first (or pass the build directory)" >&2
  exit 2
fi
cmake --build "$build" --target tandem_cli
"$build/tandem" help --markdown >docs/CLI.md.new
mv docs/CLI.md.new docs/CLI.md
echo "cli-doc.sh: wrote docs/CLI.md"
