"""The PyTorch peer of `tandem finetune --init-from` for bench/hf_step_time.sh, run in .venv-hf
(transformers, no hub downloads).

  hf_torch_peer.py make DIR [--layers L --hidden H --heads A --kv-heads K --intermediate I]
      DIR/model: a random LlamaForCausalLM of that shape (max_position_embeddings 256) with the
      SentencePiece tokenizer the tests train on the fortune cookies (tests/hf/hf_fixture.py);
      DIR/data.jsonl: the fortune cookies as {"text": ...} lines.

  hf_torch_peer.py run DIR --steps N --batch B --seq S --lr LR --warmup W --workers P --out FILE
      fine-tunes DIR/model with PyTorch DDP (gloo, P processes of one thread) on DIR/data.jsonl
      as Tandem's loop does: global batch B in P equal shares, texts with BOS, truncated and
      padded to S, next-token loss over the tokens that are not padding (one mean over the global
      batch), AdamW (weight decay 0.01), linear warmup from 0 and cosine decay to 10 %. Writes
      {"step_ms": [...], "losses": [...]} to FILE (rank 0's step times, the global batch's loss).
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "hf"))
import hf_fixture  # noqa: E402  (the tests' tokenizer and corpus)

CORPUS = "/usr/share/games/fortunes"


def make(a):
    os.makedirs(a.dir, exist_ok=True)
    sp_file = hf_fixture.train_tokenizer(CORPUS, os.path.join(a.dir, "sp"))
    tok = hf_fixture.transformers_tokenizer(sp_file, add_bos_token=True, add_eos_token=False)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model_dir = os.path.join(a.dir, "model")
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    with open(sp_file, "rb") as src, open(os.path.join(model_dir, "tokenizer.model"), "wb") as dst:
        dst.write(src.read())
    with open(os.path.join(a.dir, "data.jsonl"), "w") as f:
        for d in hf_fixture.documents(CORPUS, 4000):
            f.write(json.dumps({"text": d}) + "\n")
    return 0


def lr_at(step, a):  # Tandem's LrSchedule with min_ratio 0.1
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    t = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def worker(rank, a):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    dist.init_process_group("gloo", rank=rank, world_size=a.workers)
    model_dir = os.path.join(a.dir, "model")
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [json.loads(line)["text"] for line in open(os.path.join(a.dir, "data.jsonl"))]
    pad = tok.eos_token_id
    ids = torch.full((len(texts), a.seq), pad, dtype=torch.long)
    labels = torch.full((len(texts), a.seq), -100, dtype=torch.long)
    for i, t in enumerate(texts):
        v = tok(t)["input_ids"][:a.seq]
        ids[i, :len(v)] = torch.tensor(v)
        labels[i, :len(v)] = torch.tensor(v)
    model = torch.nn.parallel.DistributedDataParallel(LlamaForCausalLM.from_pretrained(model_dir))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    perm, pos = torch.randperm(len(texts), generator=g), 0
    share = a.batch // a.workers
    step_ms, losses = [], []
    for step in range(a.steps):
        if pos + a.batch > len(texts):
            perm, pos = torch.randperm(len(texts), generator=g), 0
        rows = perm[pos + rank * share:pos + (rank + 1) * share]
        pos += a.batch
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, a)
        x, y = ids[rows], labels[rows]
        logits = model(input_ids=x).logits
        loss_sum = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                                     y[:, 1:].reshape(-1), ignore_index=-100, reduction="sum")
        stats = torch.tensor([loss_sum.item(), float((y[:, 1:] != -100).sum())])
        dist.all_reduce(stats)
        # DDP averages gradients over the workers: scaled so they are the global batch's mean.
        (loss_sum * a.workers / stats[1]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_ms.append((time.perf_counter() - t0) * 1000)
        losses.append((stats[0] / stats[1]).item())
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"step_ms": step_ms, "losses": losses}, f)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["make", "run"])
    p.add_argument("dir")
    for name, default in (("layers", 4), ("hidden", 256), ("heads", 4), ("kv-heads", 2), ("intermediate", 688),
                          ("steps", 30), ("batch", 16), ("seq", 128), ("warmup", 5), ("workers", 2),
                          ("port", 29517)):
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--out", default="torch.json")
    a = p.parse_args()
    if a.mode == "make":
        return make(a)
    mp.spawn(worker, args=(a,), nprocs=a.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
