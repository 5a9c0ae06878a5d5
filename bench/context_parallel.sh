#!/usr/bin/env bash
# Context parallelism (--cp) on one random Llama (4 layers, width 256, 4 heads, MLP 688, the
# fixture's 800-piece vocabulary, positions up to 4096) made by transformers in .venv-hf:
# tandem finetune --init-from at --seq 512/1024/2048/4096 and --cp 1/2/4 (-n cp; cp 1 is one
# worker), global batch 2, STEPS steps, the sizes interleaved REPS times. Per run: the median
# step, the largest peak activation memory over the ranks (MemoryMeter: what a step allocated
# above its start), the plan's activation memory for the layout, and the share of the ring's
# key/value transfers hidden behind the attention blocks. Also, per --seq, the no-communication
# ceiling of 2 workers: two one-worker runs of batch 1 side by side (each half of the work, no
# communication); a cp run's speedup over one worker is to be read against it.
# usage: bench/context_parallel.sh [TANDEM] [STEPS] [REPS]
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
tandem=${1:-$src/build/tandem}
steps=${2:-4}
reps=${3:-2}
py=$src/.venv-hf/bin/python
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
. "$src/bench/llama_lib.sh"
random_llama "$work/model" 256 688 4 4 4096
"$py" - "$work" <<'PY'
import json, os, sys
work = sys.argv[1]
docs, root = [], "/usr/share/games/fortunes"
for name in sorted(os.listdir(root)):
    p = os.path.join(root, name)
    if os.path.isfile(p) and not os.path.islink(p) and not name.endswith((".dat", ".u8")):
        docs += [d.strip() for d in open(p, encoding="utf-8", errors="replace").read().split("\n%\n") if d.strip()]
    if len(docs) >= 200:
        break
# Long documents: fortunes joined, so that rows fill --seq instead of padding it.
text = " ".join(docs)
with open(f"{work}/data.jsonl", "w") as f:
    for i in range(16):
        f.write(json.dumps({"text": text[i * 3000:] + text[:i * 3000]}) + "\n")
PY
finetune() {  # finetune METRICS ARGS...
  local m=$1; shift
  "$tandem" finetune "$@" --init-from "$work/model" --data "$work/data.jsonl" --valid-fraction 0 --steps "$steps" \
    --lr 1e-4 --warmup-steps 0 --no-eval --no-progress --threads 1 --metrics "$m"
}
run() {  # seq cp
  local seq=$1 cp=$2 args=(-n "$2" --cp "$2")
  [ "$cp" = 1 ] && args=(-n 1 --strategy single)
  finetune "$work/m.jsonl" "${args[@]}" --seq "$seq" --batch 2 >"$work/log" 2>&1 || { tail -20 "$work/log"; exit 1; }
  "$py" - "$work/m.jsonl" "$seq" "$cp" <<'PY'
import json, sys
rep = [json.loads(l) for l in open(sys.argv[1]) if '"report"' in l][-1]
act = max(rep["peak_activation_bytes"]) / 2**20
plan = rep["plan_memory_bytes"][3] / 2**20 if len(rep.get("plan_memory_bytes", [])) == 4 else float("nan")
hidden = 100 * rep.get("ring_hidden_fraction", 0.0)
print(f"run seq {sys.argv[2]:>4} cp {sys.argv[3]} step {rep['step_ms_median']:9.1f} ms  activations {act:8.1f} MiB  "
      f"plan {plan:8.1f} MiB  ring hidden {hidden:5.1f} %")
PY
}
ceiling() {  # seq: two one-worker runs of batch 1 at once
  local seq=$1
  finetune "$work/a.jsonl" -n 1 --strategy single --seq "$seq" --batch 1 >"$work/la" 2>&1 &
  finetune "$work/b.jsonl" -n 1 --strategy single --seq "$seq" --batch 1 >"$work/lb" 2>&1
  wait
  "$py" - "$work/a.jsonl" "$work/b.jsonl" "$seq" <<'PY'
import json, sys
ms = [[json.loads(l) for l in open(p) if '"report"' in l][-1]["step_ms_median"] for p in sys.argv[1:3]]
print(f"run seq {sys.argv[3]:>4} pair step {max(ms):9.1f} ms  (two batch-1 workers side by side)")
PY
}
for rep in $(seq "$reps"); do
  for seq in 512 1024 2048 4096; do
    for cp in 1 2 4; do run "$seq" "$cp"; done
    ceiling "$seq"
  done
done | tee "$work/all.txt"
echo "== medians over $reps repetition(s); speedup = one worker's step / this step; ceiling = one worker's step /"
echo "   the side-by-side pair's step (what 2 workers reach without communicating)"
"$py" - "$work/all.txt" <<'PY'
import re, statistics, sys
runs, pairs = {}, {}
for line in open(sys.argv[1]):
    m = re.match(r"run seq +(\d+) cp (\d) step +([\d.]+) ms +activations +([\d.]+) MiB +plan +([\d.na]+) MiB +ring hidden +([\d.]+)", line)
    if m:
        runs.setdefault((int(m[1]), int(m[2])), []).append([float(m[i]) for i in range(3, 7)])
    m = re.match(r"run seq +(\d+) pair step +([\d.]+)", line)
    if m:
        pairs.setdefault(int(m[1]), []).append(float(m[2]))
print("| seq | cp | step | speedup | ceiling | activations / rank | vs cp 1 | plan | plan error | ring hidden |")
print("|---|---|---|---|---|---|---|---|---|---|")
for (seq, cp) in sorted(runs):
    med = [statistics.median(c) for c in zip(*runs[(seq, cp)])]
    one = [statistics.median(c) for c in zip(*runs[(seq, 1)])]
    ceil = one[0] / statistics.median(pairs[seq]) if seq in pairs else float("nan")
    err = (med[2] - med[1]) / med[1] * 100
    print(f"| {seq} | {cp} | {med[0]:.0f} ms | {one[0] / med[0]:.2f}x | {ceil:.2f}x | {med[1]:.1f} MiB | "
          f"{med[1] / one[1]:.2f} | {med[2]:.1f} MiB | {err:+.0f} % | {med[3]:.0f} % |")
PY
