#!/usr/bin/env python3
"""The MLP whole (batch 48) against its tp2 (batch 96) and tp4 (batch 192) shards: the same
FLOPs per process. Each timed alone (one process) and 4 processes at once (one thread each, a
barrier around every forward+backward), 4 rounds. docs/BENCHMARKS.md, "Twelfth session".
usage: .venv/bin/python bench/shard_concurrency.py
"""
import torch, time, sys, multiprocessing as mp, statistics as st
def make(kind):
    torch.manual_seed(0)
    if kind=='full': L=[torch.nn.Linear(784,1024),torch.nn.ReLU(),torch.nn.Linear(1024,1024),torch.nn.ReLU(),torch.nn.Linear(1024,10)]; b=48
    elif kind=='tp4': L=[torch.nn.Linear(784,256),torch.nn.ReLU(),torch.nn.Linear(256,1024),torch.nn.ReLU(),torch.nn.Linear(1024,10)]; b=192
    elif kind=='tp2': L=[torch.nn.Linear(784,512),torch.nn.ReLU(),torch.nn.Linear(512,1024),torch.nn.ReLU(),torch.nn.Linear(1024,10)]; b=96
    return torch.nn.Sequential(*L), b
def work(kind, bar, q, iters):
    torch.set_num_threads(1)
    m,b = make(kind); x=torch.randn(b,784); y=torch.randint(0,10,(b,))
    ts=[]
    for i in range(iters):
        bar.wait(); t0=time.perf_counter()
        m.zero_grad(); torch.nn.functional.cross_entropy(m(x),y).backward()
        ts.append(time.perf_counter()-t0)
        bar.wait()
    q.put(st.median(ts[3:]))
def run(kind, n, iters=25):
    bar=mp.Barrier(n); q=mp.Queue()
    ps=[mp.Process(target=work,args=(kind,bar,q,iters)) for _ in range(n)]
    [p.start() for p in ps]; r=[q.get() for _ in ps]; [p.join() for p in ps]
    return max(r)
if __name__=='__main__':
    for rnd in range(4):
        out=[]
        for kind in ['full','tp4','tp2']:
            a=run(kind,1); c=run(kind,4)
            out.append(f"{kind}: alone {a*1e3:.2f} ms, 4 at once {c*1e3:.2f} ms, ratio {c/a:.2f}")
        print(' | '.join(out), flush=True)
