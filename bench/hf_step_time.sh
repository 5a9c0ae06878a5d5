#!/usr/bin/env bash
# Step time of `tandem finetune --init-from` (ddp, 2 workers, 1 thread each) against PyTorch DDP
# (gloo, 2 processes, 1 thread each) running transformers' own LlamaForCausalLM, on the same
# model (made here with transformers: LAYERS layers, width 256, 4 heads, SwiGLU 688, the
# fortune-cookie SentencePiece vocabulary), data, batch, optimizer (AdamW, cosine decay to 10%)
# and sequence (128). The data set is BATCH texts of at least 128 tokens, so every step's global
# batch is the whole set whatever order a sampler picks: the loss curves are comparable. The
# runs alternate Tandem, PyTorch, Tandem, ... REPS times; per run the median step time after the
# first SKIP steps, then the median over the runs, the ratio, and both loss curves.
# usage: bench/hf_step_time.sh [TANDEM] [STEPS] [REPS] [LAYERS]
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
tandem=${1:-$src/build/tandem}
steps=${2:-30}
reps=${3:-3}
layers=${4:-4}
batch=16
skip=5
py=$src/.venv-hf/bin/python
[ -x "$py" ] || { echo "$py missing: run scripts/setup-hf-venv.sh"; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
. "$src/bench/llama_lib.sh"
"$py" "$src/tests/hf/hf_fixture.py" make "$out/fx" >"$out/fx.log" 2>&1 || { cat "$out/fx.log"; exit 1; }
"$py" - "$out" "$layers" <<'PY'
import os, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
out, layers = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=800, hidden_size=256, intermediate_size=688, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
LlamaForCausalLM(cfg).save_pretrained(os.path.join(out, "model"))
PY
fortune_batch "$out" "$batch" 128
cat >"$out/torch_ddp.py" <<'PY'
import json, math, os, sys, time, torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import LlamaForCausalLM
out, steps, lr = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model = LlamaForCausalLM.from_pretrained(os.path.join(out, "model"), attn_implementation="sdpa").train()
ddp = DDP(model)
opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
ids = torch.load(os.path.join(out, "ids.pt"))
mine = ids.chunk(world)[rank]
rows = []
for step in range(steps):
    for g in opt.param_groups:  # Tandem's schedule: cosine from lr to 10% of it, no warmup
        g["lr"] = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / steps))))
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = ddp(input_ids=mine, labels=mine).loss
    loss.backward()
    opt.step()
    ms = (time.perf_counter() - t0) * 1e3
    l = loss.detach().clone()
    dist.all_reduce(l)
    rows.append({"loss": l.item() / world, "step_ms": ms})
if rank == 0:
    with open(sys.argv[4], "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
PY
lr=1e-3
echo "Llama $layers layers, width 256, seq 128, global batch $batch, $steps steps, $reps reps, $(nproc) cores"
for rep in $(seq 1 "$reps"); do
  "$tandem" finetune -n 2 --strategy ddp --threads 1 --init-from "$out/model" --data "$out/data.jsonl" \
    --valid-fraction 0 --seq 128 --batch $batch --steps "$steps" --lr $lr --warmup-steps 0 --no-eval --no-progress \
    --metrics "$out/tandem-$rep.jsonl" >"$out/tandem-$rep.log" 2>&1 || { cat "$out/tandem-$rep.log"; exit 1; }
  OMP_NUM_THREADS=1 "$py" -m torch.distributed.run --nproc_per_node 2 --master_port $((29500 + rep)) \
    "$out/torch_ddp.py" "$out" "$steps" $lr "$out/torch-$rep.jsonl" >"$out/torch-$rep.log" 2>&1 ||
    { cat "$out/torch-$rep.log"; exit 1; }
done
"$py" - "$out" "$reps" "$skip" <<'PY'
import json, statistics, sys
out, reps, skip = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def load(path):
    rows = [json.loads(l) for l in open(path)]
    return [r for r in rows if "step_ms" in r and not r.get("report")]
med = {}
for who in ("tandem", "torch"):
    runs = [statistics.median([r["step_ms"] for r in load(f"{out}/{who}-{k}.jsonl")][skip:]) for k in range(1, reps + 1)]
    med[who] = statistics.median(runs)
    print(f"{who:6s}: " + " ".join(f"{x:.1f}" for x in runs) + f" ms/step, median {med[who]:.1f}")
print(f"Tandem / PyTorch step time = {med['tandem'] / med['torch']:.3f}")
a, b = load(f"{out}/tandem-1.jsonl"), load(f"{out}/torch-1.jsonl")
print("losses (Tandem, PyTorch):", ", ".join(f"{x['loss']:.4f}/{y['loss']:.4f}" for x, y in zip(a, b)))
print(f"max |loss difference| {max(abs(x['loss'] - y['loss']) for x, y in zip(a, b)):.2g}")
PY
