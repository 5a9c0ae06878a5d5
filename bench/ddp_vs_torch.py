"""Tandem DDP against PyTorch DDP (gloo) on this machine, alternating in one run.

For each model, each repetition runs, back to back:
  tandem 1 worker | tandem N workers (ddp) | tandem N workers, no communication (ceiling) |
  torch 1 worker  | torch N workers (ddp)
and the table reports medians over repetitions: step times, the ratio Tandem/PyTorch at N
workers, each one's 1->N speedup, the ceiling (1-worker time over the no-communication
N-worker time) and each speedup as a share of that ceiling.

usage: .venv/bin/python bench/ddp_vs_torch.py [--build build] [--reps 5] [--workers 2]
       [--models mlp,cnn] [--batch 128] [--steps 30]
"""
import argparse, datetime, json, os, platform, statistics, subprocess, sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIRUN = [os.path.join(ROOT, "scripts", "mpirun-local.sh")]


def run(cmd, env=None):
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    for line in out.stdout.splitlines()[::-1]:
        line = line.strip()
        if line.startswith("{"):
            if out.returncode != 0:
                # Seen with torch's gloo: the result is printed, then a rank aborts in teardown.
                print(f"note: exit {out.returncode} after the result from {' '.join(cmd[-12:])}", file=sys.stderr)
            return json.loads(line)
    sys.exit(f"failed ({out.returncode}), no result: {' '.join(cmd)}\n{out.stdout}\n{out.stderr}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--models", default="mlp,cnn")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    bench = os.path.join(a.build, "bench_ddp")
    py = sys.executable
    tpy = os.path.join(ROOT, "bench", "torch_ddp_cpu.py")
    n = str(a.workers)
    common = ["--batch", str(a.batch), "--steps", str(a.steps), "--warmup", "5"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    rows = []
    for model in a.models.split(","):
        res = {k: [] for k in ("t1", "tn", "tnocomm", "p1", "pn", "hidden", "comm")}
        for rep in range(a.reps):
            port = str(29600 + 2 * rep + (100 if model == "cnn" else 0))
            res["t1"].append(run([bench, "--model", model, "--mode", "ddp"] + common, env)["median_ms"])
            r = run(MPIRUN + ["-n", n, bench, "--model", model, "--mode", "ddp"] + common, env)
            res["tn"].append(r["median_ms"])
            res["hidden"].append(r["hidden_fraction"])
            res["comm"].append(r["comm_ms_per_step"])
            res["tnocomm"].append(run(MPIRUN + ["-n", n, bench, "--model", model, "--mode", "nocomm"] + common, env)["median_ms"])
            penv = dict(env, MASTER_PORT=str(int(port) + 1))
            res["p1"].append(run([py, tpy, "--model", model, "--mode", "ddp"] + common, penv)["median_ms"])
            penv = dict(env, MASTER_PORT=port)
            res["pn"].append(run(MPIRUN + ["-x", "MASTER_PORT=" + port, "-n", n, py, tpy, "--model", model, "--mode", "ddp"] + common, penv)["median_ms"])
            print(f"{model} rep {rep + 1}/{a.reps}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in res.items()), file=sys.stderr, flush=True)
        m = {k: statistics.median(v) for k, v in res.items()}
        ceiling = m["t1"] / m["tnocomm"]
        ts, ps = m["t1"] / m["tn"], m["p1"] / m["pn"]
        rows.append((model, m, ceiling, ts, ps))
    print(f"\n{datetime.date.today()} · {platform.node()} · {os.cpu_count()} cores · global batch {a.batch}, "
          f"{a.workers} workers x 1 thread, {a.steps} timed steps, median of {a.reps} alternating repetitions\n")
    print(f"| model | Tandem {n}w ms | PyTorch {n}w ms | Tandem/PyTorch | Tandem 1w ms | PyTorch 1w ms | "
          f"ceiling (1w / {n}w no comm) | Tandem speedup (% of ceiling) | PyTorch speedup (% of ceiling) | "
          f"Tandem comm ms/step, hidden |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model, m, ceiling, ts, ps in rows:
        print(f"| {model} | {m['tn']:.1f} | {m['pn']:.1f} | {m['tn'] / m['pn']:.2f} | {m['t1']:.1f} | {m['p1']:.1f} | "
              f"{ceiling:.2f}x ({m['tnocomm']:.1f} ms) | {ts:.2f}x ({100 * ts / ceiling:.0f}%) | "
              f"{ps:.2f}x ({100 * ps / ceiling:.0f}%) | {m['comm']:.1f}, {100 * m['hidden']:.0f}% |")


if __name__ == "__main__":
    main()
