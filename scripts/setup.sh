#!/usr/bin/env bash
# Installs everything Tandem needs on Debian 12 and builds it. Idempotent: packages already
# present are not reinstalled, pip reuses its download cache (~/.cache/pip), and the build is
# incremental. Usage: scripts/setup.sh [--no-build]
#   TANDEM_BUILD_DIR   build directory (default: build)
#   TANDEM_TORCH       pip requirement for torch (default: torch==2.11.0)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
build_dir=${TANDEM_BUILD_DIR:-build}
torch_req=${TANDEM_TORCH:-torch==2.11.0}
log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
t0=$(date +%s)

# ---- Debian packages
pkgs=(build-essential cmake ninja-build ccache python3 python3-venv python3-pip python3-jsonschema python3-yaml
      openmpi-bin libopenmpi-dev libgtest-dev libcli11-dev nlohmann-json3-dev zlib1g-dev
      dataset-fashion-mnist gnuplot-nox libsentencepiece-dev sentencepiece clang libclang-rt-14-dev
      fortunes fortunes-min fortunes-de fortunes-es fortunes-it fortunes-pl fortunes-ru fortunes-cs
      iproute2 util-linux)  # ip, unshare: the network-namespace hosts of tests/netns
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
want=${torch_req#torch==}
have=$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [ "$have" != "$want" ]; then
  log "installing $torch_req into .venv (about 4.7 GB with its CUDA libraries; cached in ~/.cache/pip)"
  .venv/bin/pip install -q --disable-pip-version-check "$torch_req" numpy
else
  log "torch $have present"
fi

[ "${1:-}" = "--no-build" ] && exit 0

# ---- build
export CCACHE_BASEDIR="$root" CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
export CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-5G}
if [ ! -f "$build_dir/build.ninja" ]; then
  log "configuring $build_dir"
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
fi
log "building (a clean build takes about 5-6 minutes on 2 cores)"
cmake --build "$build_dir"
log "done in $(( $(date +%s) - t0 )) s: $build_dir/tandem"
