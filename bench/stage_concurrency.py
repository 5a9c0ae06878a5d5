#!/usr/bin/env python3
"""The MLP's two pipeline stages at a 48-sample micro-batch (tandem's 2-stage cut: Flatten,
Linear(784,1024), ReLU | Linear(1024,1024), ReLU, Linear(1024,10)), one thread per process:
each stage alone, the two stages at once, and two copies of one stage at once; each process
loops forward+backward for 3 s and reports its median. Three rounds.
docs/BENCHMARKS.md, "Thirteenth session".
usage: .venv/bin/python bench/stage_concurrency.py
"""
import torch, time, statistics as st, sys, multiprocessing as mp
def work(which, b=48):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if which==1:
        mod = torch.nn.Sequential(torch.nn.Linear(1024,1024), torch.nn.ReLU(), torch.nn.Linear(1024,10)); x=torch.randn(b,1024,requires_grad=True)
    else:
        mod = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784,1024), torch.nn.ReLU()); x=torch.randn(b,784)
    def one():
        y=mod(x); y.sum().backward()
    return one
def loop(which, secs, q):
    one=work(which); ts=[]; t_end=time.perf_counter()+secs
    while time.perf_counter()<t_end:
        t0=time.perf_counter(); one(); ts.append(time.perf_counter()-t0)
    q.put((which, st.median(ts[3:]), len(ts)))
if __name__=="__main__":
    mp.set_start_method("fork")
    for rnd in range(3):
        for combo in ([1],[0],[1,0],[1,1],[0,0]):
            q=mp.Queue(); ps=[mp.Process(target=loop,args=(w,3.0,q)) for w in combo]
            [p.start() for p in ps]; [p.join() for p in ps]
            r=[q.get() for _ in ps]
            print(rnd, combo, " ".join("s%d %.2fms"%(w,1e3*t) for w,t,n in sorted(r)))
