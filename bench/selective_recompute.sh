#!/usr/bin/env bash
# Activation memory and step time of `tandem finetune --init-from` on a random Llama (made here
# with transformers: LAYERS layers, width 256, 4 heads, SwiGLU 688, the fixture's 800-piece
# vocabulary), 256 tokens, batch 8, one worker with one thread, under --activation-checkpointing
# none, selective and every, run in the order none selective every every selective none (a
# change of machine speed hits each alike). Per run: the report's peak activations (CPU tensor
# bytes above a step's start, forward and backward), the resident peak, the median step and the
# seconds spent recomputing.
# usage: bench/selective_recompute.sh [TANDEM] [STEPS] [LAYERS]
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
tandem=${1:-$src/build/tandem}
steps=${2:-12}
layers=${3:-4}
py=$src/.venv-hf/bin/python
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
. "$src/bench/llama_lib.sh"
random_llama "$work/model" 256 688 "$layers" 4 256
"$py" - "$work/c.jsonl" <<'PY'
import json, os, sys
root, docs = "/usr/share/games/fortunes", []
for n in sorted(os.listdir(root)):
    p = os.path.join(root, n)
    if os.path.isfile(p) and not os.path.islink(p) and not n.endswith((".dat", ".u8")):
        docs += [d.strip() for d in open(p, encoding="utf-8", errors="replace").read().split("\n%\n") if d.strip()]
with open(sys.argv[1], "w") as f:
    for d in docs[:3000]:
        f.write(json.dumps({"text": d}) + "\n")
PY
printf "%-10s %16s %12s %14s %14s %12s\n" recompute "activations MiB" "peak MiB" "median ms" "recompute s" "final loss"
for ac in none selective every every selective none; do
  "$tandem" finetune --init-from "$work/model" --data "$work/c.jsonl" --seq 256 --batch 8 --steps "$steps" \
    --lr 1e-3 --warmup-steps 2 --no-eval -n 1 --strategy single --threads 1 --no-progress \
    --activation-checkpointing "$ac" --metrics "$work/$ac.jsonl" >"$work/log" 2>&1 ||
    { tail -20 "$work/log"; exit 1; }
  "$py" - "$work/$ac.jsonl" "$ac" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
r = [l for l in lines if "report" in l][-1]
loss = [l["loss"] for l in lines if "loss" in l and "report" not in l][-1]
print(f"{sys.argv[2]:10s} {r['peak_activation_bytes'][0] / 2**20:16.1f} {r['peak_rss_bytes'][0] / 2**20:12.0f} "
      f"{r['step_ms_median']:14.1f} {r['recompute_seconds']:14.2f} {loss:12.6f}")
PY
done
