#!/usr/bin/env bash
# Installs everything Tandem needs on Debian 12 and builds the `tandem` program with its
# libraries. Idempotent: packages already present are not reinstalled, pip reuses its download
# cache (~/.cache/pip), and the build is incremental.
# Usage: scripts/setup.sh [--no-build | --all]
#   --no-build         packages and .venv only
#   --all              build every target: also the tests, benchmarks, plugins and fuzzers
#                      (scripts/test.sh uses this)
#   TANDEM_BUILD_DIR   build directory (default: build)
#   TANDEM_TORCH       pip requirement for torch (default: torch==2.11.0)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
build_dir=${TANDEM_BUILD_DIR:-build}
torch_req=${TANDEM_TORCH:-torch==2.11.0}
log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
t0=$(date +%s)
build=tandem  # tandem: the CLI and its libraries; all: every target; none
for a in "$@"; do
  case "$a" in
    --no-build) build=none ;;
    --all) build=all ;;
    *) echo "setup.sh: unknown argument '$a' (usage: scripts/setup.sh [--no-build | --all])" >&2; exit 2 ;;
  esac
done

# ---- Debian packages
pkgs=(build-essential cmake ninja-build ccache python3 python3-venv python3-pip python3-jsonschema python3-yaml
      openmpi-bin libopenmpi-dev libgtest-dev libcli11-dev nlohmann-json3-dev zlib1g-dev
      libprotobuf-dev protobuf-compiler libboost-dev
      dataset-fashion-mnist gnuplot-nox libsentencepiece-dev sentencepiece clang libclang-rt-14-dev
      fortunes fortunes-min fortunes-de fortunes-es fortunes-it fortunes-pl fortunes-ru fortunes-cs
      iproute2 util-linux   # ip, unshare: the network-namespace hosts of tests/netns
      clang-format)         # scripts/format.sh (CI checks the formatting with Debian 12's, version 14)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  log "installing Debian packages: ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  log "Debian packages present"
fi

# ---- torch (LibTorch inside the pip wheel) in a project-local virtual environment
py=${TANDEM_PYTHON_BIN:-python3}
if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  "$py" -m venv .venv
fi
# Free space (GiB, one decimal) on the filesystem holding $1 (or its nearest existing parent).
free_gib() {
  local d=$1
  while [ ! -e "$d" ]; do d=$(dirname "$d"); done
  df -Pk "$d" | awk 'NR==2 { printf "%.1f", $4 / 1048576 }'
}
# Stops with what is short, where, and what to do, instead of pip's or the compiler's
# "No space left on device" halfway through (a CI machine was once seen with 287 MB free).
need_space() {  # need_space DIR GIB WHAT
  local have
  have=$(free_gib "$1")
  if awk -v h="$have" -v n="$2" 'BEGIN { exit !(h < n) }'; then
    printf '\033[1m[setup]\033[0m error: %s GiB free on the disk holding %s; %s needs about %s GiB.\n' "$have" "$1" "$3" "$2" >&2
    printf '        Free space there (e.g. remove old build/ or .venv/ directories, `pip cache purge`, `ccache -C`),\n' >&2
    printf '        or point TMPDIR, PIP_CACHE_DIR and TANDEM_BUILD_DIR at a larger disk, then run this again.\n' >&2
    exit 1
  fi
}

want=${torch_req#torch==}
have=$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [ "$have" != "$want" ]; then
  log "installing $torch_req into .venv (about 4.7 GB with its CUDA libraries; cached in ~/.cache/pip)"
  # Installed: 4.7 GB; while installing, the downloaded wheels (about 3.5 GB) sit beside it.
  need_space "$root/.venv" 6 "installing torch with its CUDA libraries into .venv"
  need_space "${TMPDIR:-/tmp}" 1 "pip's unpacking (TMPDIR)"
  if ! .venv/bin/pip install -q --disable-pip-version-check "$torch_req" numpy; then
    log "error: pip could not install $torch_req into .venv ($(free_gib "$root/.venv") GiB free there now)." >&2
    log "       If pip said \"No space left on device\", free disk space and run this again; otherwise see its message above." >&2
    exit 1
  fi
else
  log "torch $have present"
fi

[ "$build" = none ] && exit 0

# ---- build
export CCACHE_BASEDIR="$root" CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
export CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-5G}
# A clean build takes 0.7 GB, and ccache up to CCACHE_MAXSIZE beside it.
case "$build_dir" in /*) build_path=$build_dir ;; *) build_path=$root/$build_dir ;; esac
need_space "$build_path" 1.5 "building Tandem"
if [ ! -f "$build_dir/build.ninja" ]; then
  log "configuring $build_dir"
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
fi
if [ "$build" = all ]; then
  log "building every target (the tests, benchmarks and fuzzers too)"
  cmake --build "$build_dir"
else
  # tandem_cli is the `tandem` program (the target `tandem` is the core library); building it
  # builds libtandem and libtandem_apps, all that `build/tandem train` needs.
  log "building the tandem program and its libraries (scripts/test.sh builds the rest)"
  cmake --build "$build_dir" --target tandem_cli
fi
log "done in $(( $(date +%s) - t0 )) s: $build_dir/tandem"
