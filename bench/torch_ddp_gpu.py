#!/usr/bin/env python3
"""PyTorch's own DDP (NCCL, one process) on the models of bench/gpu_bench.cpp, for
scripts/gpu-check.sh: the same shapes, batch, precision and optimizer as the C++ side.

  torch_ddp_gpu.py --model cnn|transformer [--batch B] [--steps N] [--warmup W]
                   [--layers L] [--dmodel D] [--heads H] [--seq S] [--no-oom-retry]
  torch_ddp_gpu.py --matmul [--n 8192]      measured dense bf16 matmul rate (TFLOP/s)

Prints one line "RESULT {json}". Exit codes: 0 ok, 1 failure, 2 usage / no CUDA.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


# ---- models: mirror bench/gpu_bench.cpp exactly (module structure, shapes, ops)

class Cnn(nn.Module):
    """conv32-conv64-fc128-fc10 on 1x28x28 inputs."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


class Block(nn.Module):
    """Pre-LN block: x + proj(attn(ln1(x))), then x + fc2(gelu(fc1(ln2(x)))); non-causal SDPA."""

    def __init__(self, d, h):
        super().__init__()
        self.heads = h
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        B, S, D = x.shape
        t = self.qkv(self.ln1(x)).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(t[0], t[1], t[2])
        x = x + self.proj(a.transpose(1, 2).reshape(B, S, D))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x


class Transformer(nn.Module):
    def __init__(self, layers, d, h):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d, h) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.ln_f(x)


def transformer_flops(args, params, batch):
    # Same convention as gpu_bench.cpp: 6*params*tokens + 12*layers*seq^2*d_model*batch.
    tokens = batch * args.seq
    return 6.0 * params * tokens + 12.0 * args.layers * args.seq * args.seq * args.dmodel * batch


def quantile(v, q):
    s = sorted(v)
    return s[int(round(q * (len(s) - 1)))] if s else 0.0


def matmul_rate(n):
    dev = torch.device("cuda", 0)
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(5):
        torch.matmul(a, b)
    torch.cuda.synchronize()
    iters = 30
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        torch.matmul(a, b)
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / iters
    tflops = 2.0 * n ** 3 / (ms / 1e3) / 1e12
    return {"what": "matmul", "n": n, "dtype": "bfloat16", "ms": ms, "tflops": tflops,
            "device": torch.cuda.get_device_name(0)}


def bench_once(args, batch):
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1234)
    if args.model == "cnn":
        model = Cnn().to(dev)
        x = torch.randn(batch, 1, 28, 28, generator=gen).to(dev)
        y = torch.randint(0, 10, (batch,), generator=gen).to(dev)
        autocast = False
    else:
        model = Transformer(args.layers, args.dmodel, args.heads).to(dev)
        x = torch.randn(batch, args.seq, args.dmodel, device=dev)
        y = None
        autocast = True
    params = sum(p.numel() for p in model.parameters())
    ddp = DDP(model, device_ids=[0])
    # foreach=False: the same per-tensor AdamW arithmetic as LibTorch's torch::optim::AdamW.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = ddp(x)
            loss = out.float().pow(2).mean() if autocast else F.cross_entropy(out, y)
        loss.backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(dev)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
    ev[0].record()
    for s in range(args.steps):
        step()
        ev[s + 1].record()
    torch.cuda.synchronize()
    ms = [ev[s].elapsed_time(ev[s + 1]) for s in range(args.steps)]
    total = ev[0].elapsed_time(ev[args.steps])
    peak = torch.cuda.max_memory_allocated(dev)
    return ms, total, params, peak


def bench(args):
    torch.cuda.set_device(0)
    fd, store = tempfile.mkstemp(prefix="torch-ddp-gpu-store-")
    os.close(fd)
    os.unlink(store)  # the file store creates it
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        batch = args.batch
        while True:
            try:
                ms, total, params, peak = bench_once(args, batch)
                break
            except torch.cuda.OutOfMemoryError:
                if args.no_oom_retry or batch <= 1:
                    raise
                print(f"torch_ddp_gpu: out of memory at batch {batch}; retrying with batch {batch // 2}",
                      file=sys.stderr, flush=True)
                batch //= 2
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
        if os.path.exists(store):
            os.unlink(store)
    med = statistics.median(ms)
    flops, formula = 0.0, ""
    if args.model == "transformer":
        flops = transformer_flops(args, params, batch)
        formula = "6*params*tokens + 12*layers*seq^2*d_model*batch (tokens = batch*seq; non-causal attention)"
    tflops = flops / (med / 1e3) / 1e12 if flops else 0.0
    res = {
        "framework": "torch", "model": args.model, "world_size": 1, "backend": "nccl",
        "batch": batch, "requested_batch": args.batch, "steps": args.steps, "warmup": args.warmup,
        "params": params, "ms_median": med, "ms_p10": quantile(ms, 0.1), "ms_p90": quantile(ms, 0.9),
        "ms_mean_throughput": total / args.steps, "peak_mem_gb": peak / 1e9, "flops_per_step": flops,
        "tflops": tflops, "mfu_vs_989": tflops / 989.0, "flops_formula": formula,
        "precision": "bf16 autocast" if args.model == "transformer" else "fp32 (TF32 convolutions per PyTorch defaults)",
        "optimizer": "AdamW (torch.optim, foreach=False)",
        "ddp": "torch DDP defaults (bucket_cap_mb=25, gradient_as_bucket_view=False)",
        "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "tf32_cudnn": torch.backends.cudnn.allow_tf32,
    }
    if args.model == "transformer":
        res.update(layers=args.layers, d_model=args.dmodel, heads=args.heads, seq=args.seq)
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["cnn", "transformer"], default="cnn")
    p.add_argument("--batch", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dmodel", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--no-oom-retry", action="store_true")
    p.add_argument("--matmul", action="store_true", help="measure the bf16 matmul rate instead")
    p.add_argument("--n", type=int, default=8192, help="matrix size for --matmul")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("torch_ddp_gpu: no CUDA device visible", file=sys.stderr)
        return 2
    if args.matmul:
        print("RESULT " + json.dumps(matmul_rate(args.n)), flush=True)
        return 0
    tf = args.model == "transformer"
    args.batch = args.batch or (32 if tf else 512)
    args.steps = args.steps or (20 if tf else 50)
    args.warmup = args.warmup if args.warmup is not None else (5 if tf else 10)
    if args.steps < 1 or args.batch < 1 or args.dmodel % args.heads:
        print("torch_ddp_gpu: need --steps >= 1, --batch >= 1 and heads dividing dmodel", file=sys.stderr)
        return 2
    print("RESULT " + json.dumps(bench(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
