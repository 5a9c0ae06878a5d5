"""PyTorch's own DDP (gloo, CPU) on the same models and synthetic data as bench_ddp.cpp.

Run under mpirun (rank and world size from OMPI_COMM_WORLD_*), or alone for one worker:
  python bench/torch_ddp_cpu.py --model mlp|cnn --batch GLOBAL --steps N --warmup W --mode ddp|nocomm
Prints one JSON line on rank 0 with the slowest rank's median step time.
"""
import argparse, json, os, statistics, time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def make_model(name):
    if name == "mlp":  # tandem::models::mlp(): 784-1024-1024-10
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                             nn.Linear(1024, 10))
    if name == "cnn":  # tandem::models::cnn()
        return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                             nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))
    raise SystemExit(f"unknown model {name}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--mode", default="ddp", choices=["ddp", "nocomm"])
    a = ap.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = make_model(a.model)
    net = nn.parallel.DistributedDataParallel(model) if a.mode == "ddp" else model
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    b = a.batch // world
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(b, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (b,), generator=g)
    ms = []
    dist.barrier()
    for s in range(a.warmup + a.steps):
        if s == a.warmup:
            dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        if s >= a.warmup:
            ms.append(1000 * (time.perf_counter() - t0))
    dist.barrier()
    med = torch.tensor([statistics.median(ms)], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(json.dumps({"impl": "torch", "model": a.model, "mode": a.mode, "world": world, "batch": a.batch,
                          "steps": a.steps, "median_ms": med.item(), "rank0_mean_ms": statistics.mean(ms)}),
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
