#!/usr/bin/env bash
# Creates .venv-hf (git-ignored), the test-only Python environment of the Hugging Face
# cross-checks (tests/unit/test_safetensors*.cpp, tests/unit/test_llama.cpp, tests/hf/*.py):
# safetensors, transformers, sentencepiece, numpy and peft from PyPI, tensorboard (its
# EventAccumulator reads back the --tensorboard event files, tests/e2e/tensorboard.sh) and
# megatron-core without its dependencies (its IndexedDataset reads `tandem preprocess` output).
# torch comes from .venv through a .pth file, so the 4.7 GB wheel is not installed a second time;
# .venv must exist (scripts/setup.sh). pip sees that torch as installed; a constraint pins it to .venv's version,
# so a package wanting another torch fails the install instead of downloading a second one.
# Idempotent. Tests that need .venv-hf fail, saying so, while it is absent (scripts/test.sh sets it up).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
log() { printf '\033[1m[setup-hf]\033[0m %s\n' "$*"; }
if [ ! -x .venv/bin/python ]; then
  echo "setup-hf-venv.sh: .venv is missing; run scripts/setup.sh first (it installs torch there)" >&2
  exit 1
fi
if [ ! -x .venv-hf/bin/python ]; then
  log "creating .venv-hf"
  .venv/bin/python -m venv .venv-hf
fi
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
hf_site=$(.venv-hf/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$site" > "$hf_site/zz_tandem_venv.pth"
if .venv-hf/bin/python -c 'import safetensors, transformers, sentencepiece, numpy, torch, peft, tensorboard' 2>/dev/null; then
  log "safetensors, transformers, sentencepiece, peft, tensorboard present"
else
  log "installing safetensors transformers sentencepiece numpy peft tensorboard into .venv-hf"
  torch_version=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("torch"))')
  constraints=$(mktemp)
  trap 'rm -f "$constraints"' EXIT
  echo "torch==$torch_version" >"$constraints"
  .venv-hf/bin/pip install -q --disable-pip-version-check -c "$constraints" safetensors transformers sentencepiece numpy peft tensorboard
fi
# Megatron-LM's reader of the indexed dataset that `tandem preprocess` writes (e2e_hf_packed reads the
# files with it). --no-deps: the reader needs numpy and torch only, both here already.
if .venv-hf/bin/python -c 'import megatron.core' 2>/dev/null; then
  log "megatron-core present"
else
  log "installing megatron-core (--no-deps) into .venv-hf"
  .venv-hf/bin/pip install -q --disable-pip-version-check --no-deps megatron-core
fi
.venv-hf/bin/python -c 'import safetensors, transformers, peft, torch; print("[setup-hf] transformers", transformers.__version__, "safetensors", safetensors.__version__, "peft", peft.__version__, "torch", torch.__version__, "from", torch.__file__)'
