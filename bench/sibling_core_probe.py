# A one-thread convolution forward+backward (batch 48), timed for SECONDS: pin it to one core
# while the other is idle, spins on sched_yield or runs a busy loop (docs/BENCHMARKS.md, sixteenth
# session). usage: taskset -c 0 .venv/bin/python bench/sibling_core_probe.py SECONDS
import torch, time, sys
torch.set_num_threads(1)
x = torch.randn(48, 1, 28, 28)
c1 = torch.nn.Conv2d(1, 32, 3, padding=1); c2 = torch.nn.Conv2d(32, 64, 3, padding=1)
def it():
    y = torch.relu(c2(torch.relu(c1(x)))).sum(); y.backward()
for _ in range(5): it()
t=time.perf_counter(); n=0
while time.perf_counter()-t < float(sys.argv[1]): it(); n+=1
print((time.perf_counter()-t)/n*1000)
