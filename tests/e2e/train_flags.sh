#!/usr/bin/env bash
# Flags of `tandem train` that change one thing, each checked for that thing (the MLP, or the
# CNNs, 6 steps of DDP on 2 workers, constant learning rate, plain SGD):
#   --scale-lr          --lr 0.01 --scale-lr follows --lr 0.02 step for step (2 workers: lr x 2),
#                       and --lr 0.01 without it does not
#   --compress fp16     the all-reduce payload per step is half of the uncompressed run's, and
#                       the losses stay within 1e-5 relative of it
#   --no-overlap        the same losses as the overlapped run (the same buckets, summed alike),
#                       and the report's hidden share of the all-reduce time under 10% (every
#                       bucket goes out after backward; buckets in flight together count once).
#                       Overlap's own share is not checked: on shared cores it can be as low
#   --activation-checkpointing every
#                       the same losses as without (recomputing gives the same values), the
#                       report and the metrics name the recomputation; on a 4-layer transformer
#                       (`tandem pretrain`) the measured activation memory falls below half
#   --activation-checkpointing selective
#                       `tandem pretrain`: the same losses, the metrics name it and its seconds
#                       of recomputation
#   --model cnn_bn      the report names it, 192 parameters more than cnn (2 x (32 + 64) for the
#                       BatchNorm scales and shifts), the running statistics broadcast every step
#                       (>= 768 bytes, cnn's broadcast stays under 100), and it trains
# usage: train_flags.sh TANDEM
set -euo pipefail
tandem=$1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
common=(-n 2 --strategy ddp --batch 64 --seed 2 --max-steps 6 --optimizer sgd --momentum 0 --schedule constant
        --warmup-steps 0 --no-eval --no-baseline --no-progress --threads 1)
run() {  # NAME COMMAND ARGS...: `tandem COMMAND ARGS`, its output in NAME.log and its metrics in NAME.jsonl
  local name=$1 start=$SECONDS
  shift
  "$tandem" "$@" --metrics "$out/$name.jsonl" >"$out/$name.log" 2>&1 ||
    { cat "$out/$name.log"; echo "FAIL: $name: tandem $* exited non-zero"; exit 1; }
  echo "ran  $name ($((SECONDS - start)) s)"
}
run base train "${common[@]}" --model mlp --lr 0.02
run scale_lr train "${common[@]}" --model mlp --lr 0.01 --scale-lr
run unscaled train "${common[@]}" --model mlp --lr 0.01
run fp16 train "${common[@]}" --model mlp --lr 0.02 --compress fp16
run no_overlap train "${common[@]}" --model mlp --lr 0.02 --no-overlap
run ckpt train "${common[@]}" --model mlp --lr 0.02 --activation-checkpointing every
run cnn train "${common[@]}" --model cnn --lr 0.05
run cnn_bn train "${common[@]}" --model cnn_bn --lr 0.05
# A 4-layer transformer, whose activations dominate a step's memory.
text=(pretrain -n 1 --strategy single --data /usr/share/games/fortunes --batch 32 --threads 1 --steps 3 --no-eval
      --no-progress --max-per-label 100 --vocab 200 --tokenizer-sentences 500 --d-model 64 --heads 4 --layers 4 --seq 64)
run text "${text[@]}" --out "$out/text_model"
run text_ckpt "${text[@]}" --out "$out/text_ckpt_model" --activation-checkpointing every
run text_selective "${text[@]}" --out "$out/text_selective_model" --activation-checkpointing selective
grep -q "^recomputation  *the activations of every layer, recomputed in backward" "$out/ckpt.log" ||
  { cat "$out/ckpt.log"; echo "FAIL: the report of --activation-checkpointing every names no recomputation"; exit 1; }
grep -q "^model  *cnn_bn (421834 parameters)" "$out/cnn_bn.log" ||
  { cat "$out/cnn_bn.log"; echo "FAIL: the report of --model cnn_bn does not name it"; exit 1; }
python3 - "$(dirname "$0")" "$out" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import metrics
out = sys.argv[2]
runs = {n: metrics.load(f"{out}/{n}.jsonl") for n in
        ("base", "scale_lr", "unscaled", "fp16", "no_overlap", "ckpt", "cnn", "cnn_bn", "text", "text_ckpt",
         "text_selective")}
fails = []
def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        fails.append(what)
def worst(a, b, steps=6):
    l, r = runs[a][0], runs[b][0]
    return max(abs(x - y) / abs(x) for x, y in zip(l, r)) if len(l) == len(r) == steps else float("inf")
check(worst("base", "scale_lr") == 0.0, f"--lr 0.01 --scale-lr on 2 workers follows --lr 0.02 exactly "
      f"(worst relative difference {worst('base', 'scale_lr'):.2g})")
check(worst("unscaled", "scale_lr") > 1e-3, f"and --lr 0.01 without it does not ({worst('unscaled', 'scale_lr'):.2g})")
payload = {n: runs[n][1]["comm_bytes_per_step"]["allreduce"] for n in ("base", "fp16")}
check(payload["fp16"] * 2 == payload["base"], f"--compress fp16 all-reduces half the bytes per step "
      f"({payload['fp16']:.0f} against {payload['base']:.0f})")
check(0 < worst("base", "fp16") <= 1e-5, f"--compress fp16 losses within 1e-5 relative of fp32's, not equal "
      f"({worst('base', 'fp16'):.2g})")
check(worst("base", "no_overlap") <= 1e-7, f"--no-overlap: the overlapped run's losses ({worst('base', 'no_overlap'):.2g})")
hidden = runs["no_overlap"][1]["hidden_fraction"]
check(hidden < 0.1, f"--no-overlap: {100 * hidden:.0f}% of the all-reduce time reported hidden behind backward")
check(worst("base", "ckpt") <= 1e-7, f"--activation-checkpointing every: the same losses ({worst('base', 'ckpt'):.2g})")
check(runs["ckpt"][1]["activation_checkpointing"] == "every" and runs["base"][1]["activation_checkpointing"] == "none",
      "the metrics report names the recomputation")
check(worst("text", "text_ckpt", 3) <= 1e-7, f"pretrain --activation-checkpointing every: the same losses "
      f"({worst('text', 'text_ckpt', 3):.2g})")
peak = {n: runs[n][1]["peak_activation_bytes"][0] for n in ("text", "text_ckpt")}
check(peak["text_ckpt"] < 0.5 * peak["text"], f"and less than half the activation memory ({peak['text_ckpt'] / 2**20:.1f} "
      f"MiB against {peak['text'] / 2**20:.1f})")
sel = runs["text_selective"][1]
check(worst("text", "text_selective", 3) <= 1e-6 and sel["activation_checkpointing"] == "selective" and
      sel["recompute_seconds"] > 0, f"pretrain --activation-checkpointing selective: the same losses "
      f"({worst('text', 'text_selective', 3):.2g}), {sel['recompute_seconds']:.3f} s recomputing, "
      f"{sel['peak_activation_bytes'][0] / 2**20:.1f} MiB of activations")
cnn, bn = runs["cnn"][1], runs["cnn_bn"][1]
check(bn["parameters"] - cnn["parameters"] == 192, f"cnn_bn has 192 parameters more than cnn "
      f"({bn['parameters']} and {cnn['parameters']})")
check(bn["comm_bytes_per_step"]["broadcast"] >= 768 > 100 > cnn["comm_bytes_per_step"]["broadcast"],
      f"cnn_bn broadcasts its running statistics every step ({bn['comm_bytes_per_step']['broadcast']:.0f} bytes, "
      f"cnn {cnn['comm_bytes_per_step']['broadcast']:.0f})")
loss = runs["cnn_bn"][0]
check(loss[-1] < 0.9 * loss[0], f"cnn_bn trains ({loss[0]:.4f} -> {loss[-1]:.4f})")
sys.exit(1 if fails else 0)
PY
echo "ok: --scale-lr, --compress fp16, --no-overlap, --activation-checkpointing and --model cnn_bn have their effects"
