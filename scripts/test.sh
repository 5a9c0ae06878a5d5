#!/usr/bin/env bash
# Sets up (scripts/setup.sh), builds, and runs the whole test suite with CTest.
# Multi-rank tests run 2-4 MPI ranks oversubscribed on this machine's cores.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build_dir=${TANDEM_BUILD_DIR:-build}
ctest --test-dir "$build_dir" --output-on-failure --timeout 900 "$@"
