#!/usr/bin/env bash
# Mixture of experts on this machine's CPUs: a random Mixtral made by transformers in .venv-hf
# (4 layers, hidden 256, 8 heads / 4 key-value heads, 8 experts of width 512, top 2, vocabulary
# 1000 with the fixture's 800-piece SentencePiece tokenizer; `tandem plan --model moe_tiny`
# describes the same shape), float32, AdamW, sequence 128, global batch 8, dropless routing and
# the load-balancing loss at coefficient 0.02 on both sides. The runs alternate, REPS times:
#  (a) tandem finetune --init-from, 2 workers: --ep 2 (4 experts per rank, tokens exchanged by
#      all-to-all) against plain data parallelism (ddp: every expert on both ranks) and against
#      --tp 2 (every expert, as every layer, cut over both ranks; one replica);
#  (b) one worker: tandem finetune against transformers' MixtralForCausalLM trained by a plain
#      PyTorch loop on the same ids (output_router_logits, so that it pays the same auxiliary loss);
#  (c) each run's peak RSS per rank (Tandem's report; getrusage for PyTorch).
# Every process runs THREADS threads (default 1: two 2-worker runs fill the 2 cores, and the
# one-worker comparison measures the kernels, not how each scales its threads). The data set is
# BATCH texts of at least 128 tokens, so every step trains on the same batch. Per run the median
# step after the first SKIP; the table shows the median of the runs' medians and tokens/s
# (batch x 128 tokens per step). CF=c adds --capacity-factor c to the Tandem runs of (a).
# usage: bench/moe.sh [TANDEM] [STEPS] [REPS] [THREADS]
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
tandem=${1:-$src/build/tandem}
steps=${2:-20}
reps=${3:-3}
threads=${4:-1}
batch=8
seq=128
skip=3
aux=0.02
py=$src/.venv-hf/bin/python
[ -x "$py" ] || { echo "$py missing: run scripts/setup-hf-venv.sh"; exit 1; }
[ -x "$tandem" ] || { echo "$tandem missing: build it first (cmake --build build --target tandem_cli)"; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
. "$src/bench/llama_lib.sh"
"$py" "$src/tests/hf/hf_fixture.py" make "$work/fx" >"$work/fx.log" 2>&1 || { cat "$work/fx.log"; exit 1; }
"$py" - "$work" "$aux" <<'PY'
import os, sys, torch
from transformers import MixtralConfig, MixtralForCausalLM
work, aux = sys.argv[1], float(sys.argv[2])
torch.manual_seed(0)
cfg = MixtralConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                    router_aux_loss_coef=aux, output_router_logits=True, max_position_embeddings=256,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
MixtralForCausalLM(cfg).save_pretrained(os.path.join(work, "model"))
PY
fortune_batch "$work" "$batch" "$seq"
cat >"$work/hf_train.py" <<'PY'
import json, os, resource, sys, time, torch
from transformers import MixtralForCausalLM
work, steps, threads, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(threads)
model = MixtralForCausalLM.from_pretrained(os.path.join(work, "model"), attn_implementation="sdpa",
                                           torch_dtype=torch.float32).train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
ids = torch.load(os.path.join(work, "ids.pt"))
ms = []
for step in range(steps):
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, output_router_logits=True).loss  # language model + coef * aux
    loss.backward()
    opt.step()
    ms.append((time.perf_counter() - t0) * 1e3)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
with open(out, "w") as f:
    json.dump({"step_ms": ms, "peak_rss_bytes": [rss]}, f)
PY
tandem_run() {  # NAME REP ARGS...: tandem finetune for STEPS steps, its report row to NAME-REP.json
  local name=$1 rep=$2
  shift 2
  "$tandem" finetune "$@" --threads "$threads" --init-from "$work/model" --data "$work/data.jsonl" \
    --valid-fraction 0 --seq $seq --batch $batch --steps "$steps" --lr 1e-4 --warmup-steps 0 \
    --moe-aux-loss-coef $aux --no-eval --no-progress --metrics "$work/$name-$rep.jsonl" >"$work/$name-$rep.log" 2>&1 ||
    { tail -20 "$work/$name-$rep.log"; exit 1; }
}
cf=()
[ -n "${CF:-}" ] && cf=(--capacity-factor "$CF")
echo "Mixtral 4 layers, hidden 256, 8 experts of 512, top 2, seq $seq, batch $batch, fp32 AdamW," \
  "$steps steps x $reps reps, $threads thread(s) per process, $(nproc) cores${CF:+, capacity factor $CF}"
for rep in $(seq 1 "$reps"); do
  tandem_run ep2 "$rep" -n 2 --strategy ddp --ep 2 "${cf[@]}"
  tandem_run dp2 "$rep" -n 2 --strategy ddp "${cf[@]}"
  tandem_run tp2 "$rep" -n 2 --strategy ddp --tp 2 "${cf[@]}"
  tandem_run one "$rep" -n 1 --strategy single
  OMP_NUM_THREADS=$threads "$py" "$work/hf_train.py" "$work" "$steps" "$threads" "$work/hf-$rep.json" \
    >"$work/hf-$rep.log" 2>&1 || { tail -20 "$work/hf-$rep.log"; exit 1; }
done
"$py" - "$work" "$reps" "$skip" "$batch" "$seq" <<'PY'
import json, statistics, sys
work, reps, skip, batch, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
def tandem(name, k):
    rows = [json.loads(l) for l in open(f"{work}/{name}-{k}.jsonl")]
    steps = [r["step_ms"] for r in rows if "step_ms" in r and not r.get("report")]
    rep = [r for r in rows if r.get("report")][-1]
    return statistics.median(steps[skip:]), rep["peak_rss_bytes"]
def hf(k):
    j = json.load(open(f"{work}/hf-{k}.json"))
    return statistics.median(j["step_ms"][skip:]), j["peak_rss_bytes"]
runs = {"tandem -n 2 --ep 2": [tandem("ep2", k) for k in range(1, reps + 1)],
        "tandem -n 2 (dp2)": [tandem("dp2", k) for k in range(1, reps + 1)],
        "tandem -n 2 --tp 2": [tandem("tp2", k) for k in range(1, reps + 1)],
        "tandem -n 1": [tandem("one", k) for k in range(1, reps + 1)],
        "transformers -n 1": [hf(k) for k in range(1, reps + 1)]}
print(f"{'run':20s} {'step ms (runs)':>26s} {'median':>9s} {'tokens/s':>9s}  peak RSS MiB per rank (max of runs)")
med = {}
for name, rs in runs.items():
    med[name] = statistics.median(ms for ms, _ in rs)
    rss = [max(r[i] for _, r in rs) / 2**20 for i in range(len(rs[0][1]))]
    print(f"{name:20s} {' '.join(f'{ms:.1f}' for ms, _ in rs):>26s} {med[name]:9.1f} "
          f"{batch * seq * 1e3 / med[name]:9.0f}  {' / '.join(f'{x:.0f}' for x in rss)}")
print(f"{'ep2 / dp2 step':20s} {'':>26s} {med['tandem -n 2 --ep 2'] / med['tandem -n 2 (dp2)']:9.3f}")
print(f"{'tp2 / dp2 step':20s} {'':>26s} {med['tandem -n 2 --tp 2'] / med['tandem -n 2 (dp2)']:9.3f}")
print(f"{'Tandem / transformers':20s} {'':>26s} {med['tandem -n 1'] / med['transformers -n 1']:9.3f}")
PY
