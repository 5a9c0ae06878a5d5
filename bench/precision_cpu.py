"""Forward + backward time of the reference CNN and MLP (rebuilt in torch.nn) in fp32, bf16 and
fp16 on this CPU, one thread, batch 64: why bf16 is the mixed precision for CPUs. fp16 also with
oneDNN (mkldnn) off: on an Intel Xeon with avx512_fp16, oneDNN takes a reference kernel for an
fp16 convolution's weight gradient (docs/BENCHMARKS.md, "Mixed precision").

usage: .venv/bin/python bench/precision_cpu.py
"""
import torch, time
torch.set_num_threads(1)
import torch.nn as nn
from torch_ddp_cpu import make_model  # the same models as tandem::models
for name in ("cnn", "mlp"):
  for dt, mkldnn in [(torch.float32, True), (torch.bfloat16, True), (torch.float16, True), (torch.float16, False)]:
    with torch.backends.mkldnn.flags(enabled=mkldnn):
      m=make_model(name).to(dt); x=torch.randn(64,1,28,28,dtype=dt); y=torch.randint(0,10,(64,))
      m(x).float().sum().backward()
      t=time.time(); n=0
      while n < 5 and (n < 1 or time.time()-t < 3):  # up to 5 iterations, or 3 s
        l=nn.functional.cross_entropy(m(x).float(),y); l.backward(); n+=1
      print(name, dt, "" if mkldnn else "(mkldnn off)", (time.time()-t)/n*1000, "ms", flush=True)
