#!/usr/bin/env bash
# The benchmarks' peer venv (.venv-peers, git-ignored): DeepSpeed beside .venv's torch, without
# a second torch. DeepSpeed trains ZeRO 1-3 on CPU with gloo through its CPU accelerator (no
# oneCCL; it JIT-builds deepspeed_shm_comm_op once, about 30 s). Used by bench/zero_vs_torch.py.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "run scripts/setup.sh first (.venv with torch)" >&2; exit 1; }
[ -x .venv-peers/bin/python ] || .venv/bin/python -m venv .venv-peers
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
peer_site=$(.venv-peers/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$site" >"$peer_site/zz_tandem_venv.pth"
.venv-peers/bin/pip install -q einops hjson msgpack ninja packaging psutil py-cpuinfo "pydantic>=2" tqdm wheel
dl=$(mktemp -d)
trap 'rm -rf "$dl"' EXIT
.venv/bin/python -m pip download -q deepspeed --no-deps -d "$dl"
.venv-peers/bin/pip install -q --no-deps --no-build-isolation "$dl"/deepspeed-*.tar.gz
.venv-peers/bin/python -c 'import deepspeed; print("deepspeed", deepspeed.__version__, "in .venv-peers")'
