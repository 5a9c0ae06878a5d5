# The CNN's pipeline stage 0 (both convolutions) in one process, one thread, 4 micro-batches of 48:
# median step time in 1F1B order against GPipe order, 5 interleaved 2-s windows (docs/BENCHMARKS.md,
# sixteenth session). usage: .venv/bin/python bench/pp_stage_order_probe.py
import torch, time
torch.set_num_threads(1)
nn=torch.nn
net=nn.Sequential(nn.Conv2d(1,32,3,padding=1),nn.ReLU(),nn.MaxPool2d(2),nn.Conv2d(32,64,3,padding=1),nn.ReLU(),nn.MaxPool2d(2),nn.Flatten())
xs=[torch.randn(48,1,28,28) for _ in range(4)]
g=torch.randn(48,3136)
def step(order):
    outs={}
    for f,i in order:
        if f: outs[i]=net(xs[i])
        else: outs[i].backward(g); del outs[i]
o1=[(1,0),(1,1),(0,0),(1,2),(0,1),(1,3),(0,2),(0,3)]
og=[(1,0),(1,1),(1,2),(1,3),(0,3),(0,2),(0,1),(0,0)]
def timeit(o,sec=2.0):
    for _ in range(2): step(o)
    ts=[]; t0=time.perf_counter()
    while time.perf_counter()-t0<sec:
        t=time.perf_counter(); step(o); ts.append(time.perf_counter()-t)
    ts.sort(); return ts[len(ts)//2]*1000
for r in range(5):
    print("1f1b %.1f  gpipe %.1f" % (timeit(o1), timeit(og)))
