"""Forward + backward time of the reference CNN and MLP (rebuilt in torch.nn) in fp32, bf16 and
fp16 on this CPU, one thread, batch 64: why bf16 is the mixed precision for CPUs.

usage: .venv/bin/python bench/precision_cpu.py
"""
import torch, time
torch.set_num_threads(1)
import torch.nn as nn
from torch_ddp_cpu import make_model  # the same models as tandem::models
for name in ("cnn", "mlp"):
  for dt in [torch.float32, torch.bfloat16, torch.float16]:
    m=make_model(name).to(dt); x=torch.randn(64,1,28,28,dtype=dt); y=torch.randint(0,10,(64,))
    for i in range(3):
        m(x).float().sum().backward()
    t=time.time()
    for i in range(5):
        l=nn.functional.cross_entropy(m(x).float(),y); l.backward()
    print(name, dt, (time.time()-t)/5*1000, "ms")
