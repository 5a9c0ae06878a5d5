"""PyTorch's side of bench/fsdp_compare.sh: the transformer of tandem::models::transformer (token +
learned position embedding, pre-LN blocks with a fused qkv Linear, causal SDPA and a GELU MLP,
final LayerNorm, LM head; the same shapes and operations) with AdamW on random token ids, gloo, CPU.

  ddp          DistributedDataParallel (reference)
  fsdp         FSDP FULL_SHARD, each block its own unit (ModuleWrapPolicy({Block}); the root unit
               holds the embeddings, the final LayerNorm and the head)
  fsdp_ac      fsdp, and every block wrapped by checkpoint_wrapper (non-reentrant), applied with
               apply_activation_checkpointing after FSDP as PyTorch's recipes do

Run under mpirun (rank and world size from OMPI_COMM_WORLD_*), one thread per rank:
  python bench/torch_fsdp_cpu.py --mode MODE [--layers 8] [--d-model 256] [--heads 4] [--seq 128]
         [--vocab 512] [--batch 8] [--steps 6] [--warmup 2]
Prints one JSON line on rank 0: the slowest rank's median step ms and, per rank, the memory
bench_fsdp.cpp measures for Tandem, the same way (bench/heap_peak.c, LD_PRELOADed): the peak during
the timed steps of the bytes held through malloc plus the rank's share of resident shared
mappings, sampled together, above the heap held just before the model was built; the heap's peak
alone; the shared mappings' Pss after the steps.
"""
import argparse, ctypes, functools, json, os, statistics, time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Embedding(nn.Module):
    def __init__(self, vocab, d, seq):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        nn.init.normal_(self.tok.weight, 0.0, 0.02)
        nn.init.normal_(self.pos.weight, 0.0, 0.02)

    def forward(self, ids):
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1])).unsqueeze(0)


class Block(nn.Module):
    def __init__(self, d, heads, mlp_ratio):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, mlp_ratio * d)
        self.fc2 = nn.Linear(mlp_ratio * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))


class Transformer(nn.Module):
    def __init__(self, vocab, d, heads, layers, seq, mlp_ratio=4):
        super().__init__()
        self.emb = Embedding(vocab, d, seq)
        self.blocks = nn.ModuleList([Block(d, heads, mlp_ratio) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.ln_f(h))


def heap_call(name):
    """bench/heap_peak.c's counter `name`, or -1 when it is not preloaded."""
    try:
        f = getattr(ctypes.CDLL(None), name)
    except AttributeError:
        return -1
    f.restype = ctypes.c_longlong
    return f()


def shared_resident_bytes():
    """This process's proportional share (Pss) of its shared mappings, as bench_fsdp.cpp reads it."""
    total, shared = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 2)
            if line.startswith("Pss:"):
                total += int(head[1]) * 1024 if shared else 0
            elif len(head) >= 2 and "-" in head[0] and all(c in "0123456789abcdef-" for c in head[0]):
                shared = len(head[1]) == 4 and head[1][3] == "s"
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="fsdp", choices=["ddp", "fsdp", "fsdp_ac"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    heap_base = heap_call("heap_peak_reset")
    torch.manual_seed(0)
    model = Transformer(a.vocab, a.d_model, a.heads, a.layers, a.seq)
    psi = sum(p.numel() for p in model.parameters())
    if a.mode == "ddp":
        net = nn.parallel.DistributedDataParallel(model)
    else:
        net = FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD, auto_wrap_policy=ModuleWrapPolicy({Block}),
                   device_id=torch.device("cpu"))
        if a.mode == "fsdp_ac":
            apply_activation_checkpointing(
                net, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
                check_fn=lambda m: isinstance(m, Block))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.0)
    b = a.batch // world
    g = torch.Generator().manual_seed(1234 + rank)
    ids = torch.randint(0, a.vocab, (b, a.seq + 1), generator=g)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    ms = []
    loss_first = loss_last = None
    dist.barrier()
    for s in range(a.warmup + a.steps):
        if s == a.warmup:
            dist.barrier()
            heap_call("heap_peak_reset")  # the timed steps' peak, not the model's construction
        t0 = time.perf_counter()
        opt.zero_grad()
        out = net(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        lv = loss.item()
        if s >= a.warmup:
            ms.append(1000 * (time.perf_counter() - t0))
        if s == 0:
            loss_first = lv
        loss_last = lv
    heap = -1 if heap_base < 0 else heap_call("heap_peak_bytes") - heap_base
    total = -1 if heap_base < 0 else heap_call("heap_peak_total") - heap_base
    mine = torch.tensor([heap, statistics.median(ms), shared_resident_bytes(), total], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    if rank == 0:
        print(json.dumps({"impl": "torch", "mode": a.mode, "world": world, "batch": a.batch, "steps": a.steps,
                          "parameters": psi, "median_ms": max(t[1].item() for t in every),
                          "peak_bytes": [t[3].item() for t in every],
                          "heap_peak_bytes": [t[0].item() for t in every],
                          "shared_resident_bytes": [t[2].item() for t in every],
                          "loss_first": loss_first, "loss_last": loss_last, "torch": torch.__version__}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
