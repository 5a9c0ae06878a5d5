#!/usr/bin/env bash
# Fine-tuning step time of a Llama made locally with transformers: `tandem finetune --init-from`
# (DDP, 2 workers of one thread) against PyTorch DDP running transformers' own LlamaForCausalLM
# (gloo, 2 processes of one thread, bench/hf_torch_peer.py), with the same shape, batch,
# sequence, optimizer and schedule, in the order Tandem, PyTorch, PyTorch, Tandem, ... (ROUNDS
# pairs). Prints every run's median step (the first step left out) and the median ratio, and the
# two loss curves averaged over fifths of the run (the data order differs, so the curves are
# compared in windows, not step by step). Needs .venv-hf (scripts/setup-hf-venv.sh).
# Usage: bench/hf_step_time.sh [tandem binary] [rounds] [steps] [layers] [hidden]
set -euo pipefail
tandem=${1:-build/tandem}
rounds=${2:-3}
steps=${3:-30}
layers=${4:-4}
hidden=${5:-256}
here=$(cd "$(dirname "$0")" && pwd)
export HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error
py=$here/../.venv-hf/bin/python
[[ -x $py ]] || { echo "needs .venv-hf: scripts/setup-hf-venv.sh" >&2; exit 1; }
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
intermediate=$((hidden * 43 / 16))
"$py" "$here/hf_torch_peer.py" make "$dir" --layers "$layers" --hidden "$hidden" --intermediate "$intermediate" >/dev/null
common=(--steps "$steps" --batch 16 --seq 128 --lr 3e-4 --warmup 5)
tandem_run() {
  "$tandem" finetune --init-from "$dir/model" --task lm --data "$dir/data.jsonl" -n 2 --threads 1 --strategy ddp \
    --steps "$steps" --batch 16 --seq 128 --lr 3e-4 --warmup-steps 5 --no-eval --no-progress \
    --metrics "$dir/tandem.jsonl" >"$dir/log" 2>&1 || { cat "$dir/log"; exit 1; }
  python3 -c '
import json, sys
steps = [d for d in map(json.loads, open(sys.argv[1])) if "loss" in d and not d.get("report")]
json.dump({"step_ms": [d["step_ms"] for d in steps], "losses": [d["loss"] for d in steps]}, open(sys.argv[2], "w"))' \
    "$dir/tandem.jsonl" "$1"
}
torch_run() { "$py" "$here/hf_torch_peer.py" run "$dir" "${common[@]}" --workers 2 --out "$1"; }
for ((r = 0; r < rounds; ++r)); do
  if ((r % 2 == 0)); then tandem_run "$dir/t$r.json"; torch_run "$dir/p$r.json"
  else torch_run "$dir/p$r.json"; tandem_run "$dir/t$r.json"; fi
done
python3 - "$dir" "$rounds" "$layers" "$hidden" <<'PY'
import json, statistics, sys
d, rounds, layers, hidden = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
med = lambda xs: statistics.median(xs[1:])
t = [json.load(open(f"{d}/t{r}.json")) for r in range(rounds)]
p = [json.load(open(f"{d}/p{r}.json")) for r in range(rounds)]
print(f"Llama, {layers} layers, width {hidden}, sequence 128, global batch 16, 2 workers")
print("| round | Tandem median step ms | PyTorch DDP + transformers ms | ratio |")
print("|---|---|---|---|")
ratios = []
for r in range(rounds):
    a, b = med(t[r]["step_ms"]), med(p[r]["step_ms"])
    ratios.append(a / b)
    print(f"| {r + 1} | {a:.1f} | {b:.1f} | {a / b:.3f} |")
print(f"median ratio Tandem / PyTorch: {statistics.median(ratios):.3f}")
n = len(t[0]["losses"])
w = max(1, n // 5)
for name, runs in (("Tandem", t), ("PyTorch", p)):
    curve = [statistics.mean(statistics.mean(r["losses"][i:i + w]) for r in runs) for i in range(0, n, w)]
    print(f"{name:8s} loss by fifths: " + " ".join(f"{x:.3f}" for x in curve))
PY
