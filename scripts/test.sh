#!/usr/bin/env bash
# Sets up (scripts/setup.sh), builds every target (the tests, benchmarks, plugins and fuzzers
# as well as the tandem program), and runs the test suite with CTest. Arguments go to ctest:
#   scripts/test.sh -L unit      the quick loop: unit tests and three 20 s fuzz runs (-LE fuzz: 3 s)
#   scripts/test.sh -LE slow     all but the tests that take more than a minute each
#   scripts/test.sh -R dist      tests by name
# Labels: unit, dist (the library under mpirun), e2e (the CLI end to end), slow (> ~60 s).
# Multi-rank tests run 2-4 MPI ranks oversubscribed on this machine's cores.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --all
# .venv-hf holds the Python references (safetensors, transformers, PyTorch for the package
# tests) of the cross-checks; without it (no PyPI) those tests fail and say so.
scripts/setup-hf-venv.sh || echo "[test] .venv-hf could not be set up: the Hugging Face cross-checks will fail" >&2
build_dir=${TANDEM_BUILD_DIR:-build}
# Two at a time: a multi-rank test reserves both slots (PROCESSORS 2), so only the one-process
# tests (unit, fuzzers, bad input) share the machine.
ctest --test-dir "$build_dir" --output-on-failure --timeout 900 --parallel 2 "$@"
