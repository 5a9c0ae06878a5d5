#!/usr/bin/env bash
# Creates .venv-hf (git-ignored), the test-only Python environment of the Hugging Face
# cross-checks (tests/unit/test_safetensors*.cpp, tests/unit/test_llama.cpp): safetensors,
# transformers, sentencepiece and numpy from PyPI. torch comes from .venv through a .pth file,
# so the 4.7 GB wheel is not installed a second time; .venv must exist (scripts/setup.sh).
# Idempotent. Tests that need .venv-hf skip, saying so, while it is absent.
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
if .venv-hf/bin/python -c 'import safetensors, transformers, sentencepiece, numpy, torch' 2>/dev/null; then
  log "safetensors, transformers, sentencepiece present"
else
  log "installing safetensors transformers sentencepiece numpy into .venv-hf"
  .venv-hf/bin/pip install -q --disable-pip-version-check safetensors transformers sentencepiece numpy
fi
.venv-hf/bin/python -c 'import safetensors, transformers, torch; print("[setup-hf] transformers", transformers.__version__, "safetensors", safetensors.__version__, "torch", torch.__version__)'
