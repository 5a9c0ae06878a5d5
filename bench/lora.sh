#!/usr/bin/env bash
# LoRA against full fine-tuning on one random Llama (4 layers, width 512, 8 heads, MLP 1376,
# the fixture's 800-piece vocabulary; about 13.5 M parameters) made by transformers in .venv-hf:
# per layout (single, zero3 x 2, tp2) and mode (full, LoRA r 8 on q/k/v/o), tandem finetune
# --init-from for STEPS steps of global batch 8 x 128 tokens, interleaved REPS times. Prints one
# line per run (median step ms, rank 0's parameter / gradient / optimizer state bytes, peak RSS
# per rank, the size of the step checkpoint) and the medians per layout and mode.
# usage: bench/lora.sh [TANDEM] [STEPS] [REPS]
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
tandem=${1:-$src/build/tandem}
steps=${2:-20}
reps=${3:-3}
py=$src/.venv-hf/bin/python
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
. "$src/bench/llama_lib.sh"
random_llama "$work/big" 512 1376 4 8 256
"$py" - "$work" <<'PY'
import json, os, sys
work = sys.argv[1]
docs = []
root = "/usr/share/games/fortunes"
for name in sorted(os.listdir(root)):
    p = os.path.join(root, name)
    if os.path.isfile(p) and not os.path.islink(p) and not name.endswith((".dat", ".u8")):
        docs += [d.strip() for d in open(p, encoding="utf-8", errors="replace").read().split("\n%\n") if d.strip()]
    if len(docs) >= 400:
        break
with open(f"{work}/data.jsonl", "w") as f:
    for d in docs[:400]:
        f.write(json.dumps({"text": d}) + "\n")
PY
run() {  # layout mode rep
  local layout=$1 mode=$2 args=() lora=()
  case $layout in
    single) args=(-n 1 --strategy single) ;;
    zero3x2) args=(-n 2 --strategy zero3) ;;
    tp2) args=(-n 2 --tp 2) ;;
  esac
  [ "$mode" = lora ] && lora=(--lora-rank 8 --lora-alpha 16 --lora-targets q_proj,k_proj,v_proj,o_proj)
  rm -rf "$work/ck"
  "$tandem" finetune "${args[@]}" "${lora[@]}" --init-from "$work/big" --data "$work/data.jsonl" --valid-fraction 0 \
    --seq 128 --batch 8 --steps "$steps" --lr 1e-4 --no-eval --no-progress --checkpoint-dir "$work/ck" \
    --checkpoint-every "$steps" --metrics "$work/m.jsonl" >"$work/log" 2>&1 || { tail -20 "$work/log"; exit 1; }
  local ck; ck=$(du -sb "$work/ck/step-$(printf %08d "$steps")" | cut -f1)
  "$py" - "$work/m.jsonl" "$layout" "$mode" "$ck" <<'PY'
import json, sys
rep = [json.loads(l) for l in open(sys.argv[1]) if '"report"' in l][-1]
ms = rep["model_state_bytes_per_rank"][0]
print(f"{sys.argv[2]:8s} {sys.argv[3]:5s} step {rep['step_ms_median']:8.1f} ms  trainable {rep['trainable_parameters']:>9d} "
      f"of {rep['parameters']}  rank0 params {ms[0]/2**20:6.1f} MiB grads {ms[1]/2**20:6.2f} MiB "
      f"optimizer {ms[2]/2**20:6.2f} MiB  peak RSS {max(rep['peak_rss_bytes'])/2**20:6.0f} MiB  "
      f"checkpoint {int(sys.argv[4])/2**20:6.2f} MiB")
PY
}
for rep in $(seq "$reps"); do
  for layout in single zero3x2 tp2; do
    for mode in full lora; do run "$layout" "$mode"; done
  done
done | tee "$work/all.txt"
echo "== medians of the step time"
awk '{k=$1" "$2; v[k]=v[k]" "$4} END {for (k in v) print k, v[k]}' "$work/all.txt" | sort |
  while read -r l m rest; do
    echo "$l $m $(echo "$rest" | tr ' ' '\n' | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}') ms"
  done
