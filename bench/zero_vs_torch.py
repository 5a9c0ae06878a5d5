"""Tandem's ZeRO stages against PyTorch's (and DeepSpeed's) on this machine, alternating in one run.

Pairs (Tandem: build/bench_zero under mpirun; peers: bench/torch_zero_cpu.py, gloo):
  DDP     Tandem DistributedDataParallel   | torch DDP                                  (reference)
  ZeRO-1  Tandem ZeroDataParallel stage 1  | DDP + torch ZeroRedundancyOptimizer
  ZeRO-2  Tandem ZeroDataParallel stage 2  | FSDP SHARD_GRAD_OP
  ZeRO-3  Tandem ZeroDataParallel stage 3  | FSDP FULL_SHARD (one unit per Sequential child with parameters)
and, when DeepSpeed is importable by --ds-python (.venv-peers), DeepSpeed's ZeRO stage 1/2/3 for
the same rows. Every configuration uses the same model, optimizer (AdamW, lr 1e-3, no weight
decay), synthetic data and global batch. Each repetition runs every configuration once, in an
order rotated from one repetition to the next; the tables give medians over repetitions of each
run's step time (the slowest rank's median over the timed steps).

usage: .venv/bin/python bench/zero_vs_torch.py [--build build] [--reps 5] [--workers 2]
       [--models mlp,cnn] [--batch 128] [--steps 30] [--optimizer adamw] [--ds-python PATH|none]
       [--jsonl FILE]
"""
import argparse, datetime, json, os, platform, statistics, subprocess, sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIRUN = [os.path.join(ROOT, "scripts", "mpirun-local.sh")]

# row -> (Tandem mode, torch peer mode, DeepSpeed mode, torch peer's name)
ROWS = [("DDP", "ddp", "ddp", None, "torch DDP"),
        ("ZeRO-1", "zero1", "zero1", "ds_zero1", "ZeroRedundancyOptimizer"),
        ("ZeRO-2", "zero2", "fsdp_grad_op", "ds_zero2", "FSDP SHARD_GRAD_OP"),
        ("ZeRO-3", "zero3", "fsdp_full", "ds_zero3", "FSDP FULL_SHARD")]
TARGET = 0.9       # each Tandem stage's step time / its peer's
ZERO2_VS_DDP = 1.05  # Tandem ZeRO-2 / Tandem DDP


def run(cmd, env, log):
    """The JSON line of one run, or {"error": ...} when the run gave none."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    except subprocess.TimeoutExpired:
        return {"error": "timed out: " + " ".join(cmd)}
    for line in out.stdout.splitlines()[::-1]:
        line = line.strip()
        if line.startswith("{"):
            r = json.loads(line)
            if out.returncode != 0 and "error" not in r:
                # Seen with torch's gloo: the result is printed, then a rank aborts in teardown.
                print(f"note: exit {out.returncode} after the result from {' '.join(cmd[-14:])}", file=sys.stderr)
            if log:
                log.write(json.dumps(dict(r, cmd=" ".join(cmd))) + "\n")
                log.flush()
            return r
    tail = (out.stdout + out.stderr).strip().splitlines()[-5:]
    return {"error": f"exit {out.returncode}, no result: " + " | ".join(tail)}


def sent_per_rank(comm, n):
    """Bytes one rank sends per step with bandwidth-optimal (ring) collectives, from the counters
    (all-reduce and broadcast: the tensor; reduce-scatter: the full input; all-gather: the shard)."""
    f = {"allreduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "allgather": n - 1,
         "broadcast": (n - 1) / n, "reduce": (n - 1) / n}
    return sum(f.get(op, 1.0) * s["bytes_per_step"] for op, s in comm.items())


def ops_text(comm):
    short = {"allreduce": "AR", "reduce_scatter": "RS", "allgather": "AG", "broadcast": "BC", "reduce": "R"}
    parts = [f"{short.get(op, op)} {s['bytes_per_step'] / 1e6:.2f}" for op, s in sorted(comm.items())
             if s["bytes_per_step"] >= 1000]
    return " + ".join(parts) if parts else "0"


def med(results, key):
    v = [r[key] for r in results if "error" not in r]
    return statistics.median(v) if v else None


def fmt(v, spec=".1f"):
    return "n/a" if v is None else format(v, spec)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--models", default="mlp,cnn")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--optimizer", default="adamw", choices=["adam", "adamw"])
    ap.add_argument("--ds-python", default=os.path.join(ROOT, ".venv-peers", "bin", "python"),
                    help="interpreter with DeepSpeed installed, or 'none' to leave DeepSpeed out")
    ap.add_argument("--jsonl", default=None, help="append every run's JSON line (with its command) here")
    a = ap.parse_args()
    bench = os.path.join(a.build, "bench_zero")
    if not os.path.exists(bench):
        sys.exit(f"{bench} not found: cmake -S . -B {a.build} && ninja -C {a.build} bench_zero")
    py = sys.executable
    tpy = os.path.join(ROOT, "bench", "torch_zero_cpu.py")
    n = a.workers
    ds_py = None
    if a.ds_python != "none" and os.path.exists(a.ds_python):
        chk = subprocess.run([a.ds_python, "-c", "import deepspeed; print(deepspeed.__version__)"],
                             capture_output=True, text=True)
        if chk.returncode == 0:
            ds_py = a.ds_python
            ds_version = chk.stdout.strip().splitlines()[-1]
        else:
            print(f"DeepSpeed left out: {a.ds_python} cannot import it: {chk.stderr.strip().splitlines()[-1:]}",
                  file=sys.stderr)
    common = ["--batch", str(a.batch), "--steps", str(a.steps), "--warmup", str(a.warmup), "--optimizer", a.optimizer]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = open(a.jsonl, "a") if a.jsonl else None
    port = [29800]

    def peer(python, model, mode):
        port[0] += 1
        p = str(port[0])
        return run(MPIRUN + ["-x", "MASTER_PORT=" + p, "-n", str(n), python, tpy, "--model", model, "--mode", mode]
                   + common, dict(env, MASTER_PORT=p), log)

    def tandem(model, mode):
        return run(MPIRUN + ["-n", str(n), bench, "--model", model, "--mode", mode] + common, env, log)

    all_res = {}
    for model in a.models.split(","):
        # (row, who) -> list of results
        res = {}
        jobs = []
        for row, tmode, pmode, dmode, _ in ROWS:
            jobs.append(((row, "tandem"), lambda m=model, t=tmode: tandem(m, t)))
            jobs.append(((row, "torch"), lambda m=model, p=pmode: peer(py, m, p)))
            if ds_py and dmode:
                jobs.append(((row, "deepspeed"), lambda m=model, d=dmode: peer(ds_py, m, d)))
        for rep in range(a.reps):
            k = (2 * rep) % len(jobs)  # rotate the order: no configuration always runs first or last
            for key, job in jobs[k:] + jobs[:k]:
                res.setdefault(key, []).append(job())
            line = ", ".join(f"{r}/{w} " + ("err" if "error" in v[-1] else f"{v[-1]['median_ms']:.1f}")
                             for (r, w), v in res.items())
            print(f"{model} rep {rep + 1}/{a.reps}: {line}", file=sys.stderr, flush=True)
        all_res[model] = res

    print(f"\n{datetime.datetime.now():%Y-%m-%d %H:%M} · {platform.node()} · {os.cpu_count()} cores · global batch "
          f"{a.batch}, {n} workers x 1 thread, {a.optimizer} (lr 1e-3), {a.steps} timed steps after {a.warmup} "
          f"warm-up, median of {a.reps} alternating repetitions · torch "
          + next((r["torch"] for v in all_res.values() for k, rs in v.items() for r in rs if "torch" in r), "?")
          + (f" · DeepSpeed {ds_version}" if ds_py else " · DeepSpeed not run") + "\n")
    print("Step time (ms; ratio = Tandem / peer; target: ratio ≤ 0.9 against each peer, "
          f"Tandem ZeRO-2 ≤ {ZERO2_VS_DDP} × Tandem DDP)\n")
    print("| model | config | Tandem ms | torch peer | peer ms | Tandem/peer | target | met? | DeepSpeed ms | "
          "Tandem/DeepSpeed | met? |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    errors = []
    for model, res in all_res.items():
        for row, tmode, pmode, dmode, pname in ROWS:
            t = med(res[(row, "tandem")], "median_ms")
            p = med(res[(row, "torch")], "median_ms")
            d = med(res.get((row, "deepspeed"), []), "median_ms") if dmode else None
            for who in ("tandem", "torch", "deepspeed"):
                for r in res.get((row, who), []):
                    if "error" in r:
                        errors.append(f"{model} {row} {who}: {r['error']}")
            rp = t / p if t and p else None
            rd = t / d if t and d else None
            tgt = "reference" if row == "DDP" else f"≤ {TARGET}"
            met_p = "" if row == "DDP" or rp is None else ("yes" if rp <= TARGET else "no")
            met_d = "" if rd is None else ("yes" if rd <= TARGET else "no")
            print(f"| {model} | {row} | {fmt(t)} | {pname} | {fmt(p)} | {fmt(rp, '.2f')} | {tgt} | {met_p} | "
                  f"{fmt(d) if dmode and ds_py else '—'} | {fmt(rd, '.2f') if dmode and ds_py else '—'} | {met_d} |")
        t2, td = med(res[("ZeRO-2", "tandem")], "median_ms"), med(res[("DDP", "tandem")], "median_ms")
        if t2 and td:
            r = t2 / td
            print(f"| {model} | ZeRO-2 vs Tandem DDP | {t2:.1f} | Tandem DDP | {td:.1f} | {r:.2f} | ≤ {ZERO2_VS_DDP} | "
                  f"{'yes' if r <= ZERO2_VS_DDP else 'no'} | | | |")

    print("\nCommunication and memory per rank (from the last repetition; bytes per step in MB = 1e6 B, by "
          "operation as handed to the collective: AR all-reduce, RS reduce-scatter (full input), AG all-gather "
          "(the shard), BC broadcast; 'sent' = what one rank sends with ring collectives; state = parameters + "
          "gradients + optimizer state (incl. master copies) held after a step, MiB; RSS = peak resident set "
          "of the larger rank, MiB)\n")
    print("| model | config | impl | MB per step by op | sent MB/rank | params MiB | grads MiB | optim MiB | "
          "state MiB | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    mib = 1 << 20
    for model, res in all_res.items():
        for row, tmode, pmode, dmode, pname in ROWS:
            for who, label in (("tandem", "Tandem " + (tmode if tmode != "ddp" else "DDP")), ("torch", pname),
                               ("deepspeed", f"DeepSpeed stage {dmode[-1]}" if dmode else "")):
                rs = [r for r in res.get((row, who), []) if "error" not in r]
                if not rs:
                    continue
                r = rs[-1]
                m = r["memory"]
                print(f"| {model} | {row} | {label} | {ops_text(r['comm'])} | {sent_per_rank(r['comm'], n) / 1e6:.2f} | "
                      f"{m['parameter_bytes'] / mib:.2f} | {m['gradient_bytes'] / mib:.2f} | "
                      f"{m['optimizer_state_bytes'] / mib:.2f} | {m['total_bytes'] / mib:.2f} | "
                      f"{r['max_rss_bytes'] / mib:.0f} |")
    if errors:
        print("\nRuns without a result:")
        for e in dict.fromkeys(errors):
            print("- " + e)


if __name__ == "__main__":
    main()
