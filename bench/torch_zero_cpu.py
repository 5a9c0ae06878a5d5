"""PyTorch's own sharded data parallelism (gloo, CPU) on the same models, optimizer and synthetic
data as bench_zero.cpp: the peers of Tandem's ZeRO stages.

  ddp      DistributedDataParallel + the optimizer over the whole model (reference)
  zero1    DistributedDataParallel + torch.distributed.optim.ZeroRedundancyOptimizer (≈ ZeRO-1)
  fsdp_grad_op  FSDP, ShardingStrategy.SHARD_GRAD_OP (≈ ZeRO-2)
  fsdp_full     FSDP, ShardingStrategy.FULL_SHARD (≈ ZeRO-3)
  ds_zero1|2|3  DeepSpeed's ZeRO stage 1|2|3 (fp32, the same torch optimizer handed to
                deepspeed.initialize, gloo through DeepSpeed's CPU accelerator); needs the
                interpreter of .venv-peers, where DeepSpeed is installed
FSDP's wrap policy makes each child of the Sequential that has parameters one unit (the root
unit holds none), like Tandem's stage 3 units. Everything else is FSDP's or DeepSpeed's default.

Run under mpirun (rank and world size from OMPI_COMM_WORLD_*), or alone for one worker:
  python bench/torch_zero_cpu.py --model mlp|cnn --mode MODE --batch GLOBAL --steps N --warmup W
         [--optimizer adamw|adam] [--lr 1e-3]
Prints one JSON line on rank 0: the slowest rank's median step ms, the collectives over the
timed steps per step (bytes counted like Tandem's Communicator: all-reduce and broadcast the
tensor, reduce-scatter the input, all-gather the input; DDP's own all-reduce runs in C++ and
is counted from the gradient sizes, DDP all-reduces every gradient each step), and the
per-rank bytes of parameters, gradients and optimizer state after a step.
"""
import argparse, functools, json, os, resource, statistics, time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

MODES = ["ddp", "zero1", "fsdp_grad_op", "fsdp_full", "ds_zero1", "ds_zero2", "ds_zero3"]


from torch_ddp_cpu import make_model  # the same models as tandem::models (bench/ is on sys.path)


class CommCounter:
    """Counts the Python-level collectives FSDP and ZeroRedundancyOptimizer call (they call
    them as attributes of torch.distributed, so wrapping the attributes sees them). all_gather
    (the list form, which FSDP uses for CPU tensors) counts its input like the others."""

    OPS = {"all_reduce": ("allreduce", 0), "broadcast": ("broadcast", 0),
           "reduce_scatter_tensor": ("reduce_scatter", 1), "all_gather_into_tensor": ("allgather", 1),
           "all_gather": ("allgather", 1),  # FSDP on CPU: the list form
           "reduce": ("reduce", 0), "reduce_scatter": ("reduce_scatter", 1),
           "_reduce_scatter_base": ("reduce_scatter", 1), "_all_gather_base": ("allgather", 1)}

    def __init__(self):
        import torch.distributed.distributed_c10d as c10d
        self.on = False
        self.depth = 0  # count only the outermost call (e.g. _all_gather_base calls all_gather_into_tensor)
        self.stats = {}
        for fn, (op, arg) in self.OPS.items():
            for ns in (dist, c10d):  # DeepSpeed calls some through distributed_c10d
                orig = getattr(ns, fn, None)
                if orig is not None and not getattr(orig, "_counted", False):
                    setattr(ns, fn, self._wrap(orig, op, arg))

    def _wrap(self, orig, op, arg):
        @functools.wraps(orig)
        def f(*args, **kw):
            if self.on and self.depth == 0:
                t = args[arg] if len(args) > arg else next(
                    (kw[k] for k in (("input", "input_tensor", "input_list", "tensor") if arg else ("tensor",)) if k in kw), None)
                if isinstance(t, (list, tuple)):  # reduce_scatter's input list
                    t = torch.cat([u.reshape(-1) for u in t]) if t else torch.empty(0)
                if t is not None:
                    s = self.stats.setdefault(op, {"calls": 0, "bytes": 0})
                    s["calls"] += 1
                    s["bytes"] += t.numel() * t.element_size()
            self.depth += 1
            try:
                return orig(*args, **kw)
            finally:
                self.depth -= 1
        f._counted = True
        return f


def tensor_bytes(ts):
    seen, total = set(), 0
    for t in ts:
        key = None if t is None else (t.data_ptr(), t.numel())
        if t is None or key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def state_bytes(opt):
    return tensor_bytes(v for st in opt.state.values() for v in st.values()
                        if torch.is_tensor(v) and v.dim() > 0)  # not Adam's scalar step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--mode", default="ddp", choices=MODES)
    ap.add_argument("--optimizer", default="adamw", choices=["adam", "adamw"])
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--bucket-view", action="store_true", help="zero1: parameters_as_bucket_view=True")
    ap.add_argument("--ds-release", action="store_true",
                    help="ds_zero3: stage3_max_reuse_distance=0, stage3_param_persistence_threshold=0 (release "
                         "every gathered parameter after use and shard every parameter, as FSDP and Tandem do)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    counter = CommCounter()
    if a.mode.startswith("ds_"):
        import deepspeed
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = make_model(a.model)
    psi = sum(p.numel() for p in model.parameters())
    opt_cls = torch.optim.AdamW if a.optimizer == "adamw" else torch.optim.Adam
    opt_kw = dict(lr=a.lr, weight_decay=0.0)
    if a.mode in ("ddp", "zero1"):
        net = nn.parallel.DistributedDataParallel(model)
        if a.mode == "ddp":
            opt = opt_cls(net.parameters(), **opt_kw)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=opt_cls,
                                          parameters_as_bucket_view=a.bucket_view, **opt_kw)
    elif a.mode.startswith("ds_"):
        config = {"train_batch_size": a.batch, "train_micro_batch_size_per_gpu": a.batch // world,
                  "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True,
                  "zero_optimization": {"stage": int(a.mode[-1])}, "steps_per_print": 10 ** 9,
                  "wall_clock_breakdown": False}
        if a.ds_release:
            config["zero_optimization"].update(stage3_max_reuse_distance=0, stage3_param_persistence_threshold=0)
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt_cls(model.parameters(), **opt_kw),
                                                 config=config)
        net = engine
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
        from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy
        units = {id(c) for c in model.children() if any(True for _ in c.parameters(recurse=True))}
        policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in units)
        strategy = ShardingStrategy.SHARD_GRAD_OP if a.mode == "fsdp_grad_op" else ShardingStrategy.FULL_SHARD
        net = FSDP(model, sharding_strategy=strategy, auto_wrap_policy=policy, device_id=torch.device("cpu"))
        opt = opt_cls(net.parameters(), **opt_kw)
    b = a.batch // world
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(b, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (b,), generator=g)
    ms = []
    loss_first = loss_last = None
    dist.barrier()
    for s in range(a.warmup + a.steps):
        if s == a.warmup:
            dist.barrier()
            counter.on = True
        t0 = time.perf_counter()
        if a.mode.startswith("ds_"):
            loss = F.cross_entropy(net(x), y)
            net.backward(loss)
            net.step()  # DeepSpeed zeroes the gradients itself
        else:
            opt.zero_grad()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
        if s >= a.warmup:
            ms.append(1000 * (time.perf_counter() - t0))
        if s == 0:
            loss_first = loss.item()
        if s == a.warmup + a.steps - 1:
            loss_last = loss.item()
    counter.on = False
    dist.barrier()
    med = torch.tensor([statistics.median(ms)], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    comm = {op: {"calls_per_step": s["calls"] / a.steps, "bytes_per_step": s["bytes"] / a.steps}
            for op, s in counter.stats.items()}
    if a.mode in ("ddp", "zero1") and world > 1:  # DDP's reducer all-reduces every gradient in C++
        gb = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        comm["allreduce"] = {"bytes_per_step": float(gb), "counted": "gradient sizes (DDP's C++ reducer)"}
    master = 0
    if a.mode == "zero1":
        ostate = state_bytes(opt.optim)
    elif a.mode.startswith("ds_"):
        zopt = net.optimizer
        ostate = state_bytes(getattr(zopt, "optimizer", zopt))
        # DeepSpeed keeps its own flat fp32 partition (a copy even in fp32) that the optimizer steps.
        flat = getattr(zopt, "single_partition_of_fp32_groups", None) or getattr(zopt, "fp32_partitioned_groups_flat", None) or []
        master = tensor_bytes(flat)
    else:
        ostate = state_bytes(opt)
    params = list(net.parameters())  # FSDP: the FlatParameters, holding this rank's shard after a step
    if a.mode == "ds_zero3":  # a partitioned parameter's data is empty; its shard is p.ds_tensor
        pb = tensor_bytes([p.ds_tensor if hasattr(p, "ds_tensor") and p.data.numel() == 0 else p.data for p in params])
    else:
        pb = tensor_bytes(p.data for p in params if p.data.untyped_storage().size() > 0)
    gb = tensor_bytes(p.grad for p in params)
    memory = {"parameters": psi, "parameter_bytes": pb, "gradient_bytes": gb, "optimizer_state_bytes": ostate + master,
              "master_bytes": master, "total_bytes": pb + gb + ostate + master}
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0], dtype=torch.float64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(json.dumps({"impl": "deepspeed" if a.mode.startswith("ds_") else "torch", "model": a.model, "mode": a.mode, "optimizer": a.optimizer,
                          "world": world, "batch": a.batch, "steps": a.steps, "parameters": psi,
                          "median_ms": med.item(), "rank0_mean_ms": statistics.mean(ms),
                          "loss_first": loss_first, "loss_last": loss_last, "comm": comm, "memory": memory,
                          "max_rss_bytes": rss.item(), "torch": torch.__version__}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
