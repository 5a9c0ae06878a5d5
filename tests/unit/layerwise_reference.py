#!/usr/bin/env python3
"""Reference LARS and LAMB steps in float64 PyTorch, written from the papers' algorithms
independently of the C++ code: You et al. 2017 (LARS, Algorithm 1: the global learning rate
inside the momentum) and You et al. 2019 (LAMB, Algorithm 2, as NVIDIA Apex's FusedLAMB and
timm's Lamb without their gradient clipping). Parameters of dimension <= 1 get neither trust
ratio nor weight decay unless adapt_vectors. Writes tests/data/optim/layerwise_reference.json,
which tests/unit/test_optim.cpp replays. Regenerate with
    .venv/bin/python tests/unit/layerwise_reference.py
"""
import json
import os

import torch

torch.manual_seed(1234)
DT = torch.float64


def params():
    # A matrix, a bias, a norm weight, and a zero-initialised matrix (its trust ratio is 1).
    return [torch.randn(3, 4, dtype=DT), torch.randn(3, dtype=DT) * 0.1,
            torch.ones(4, dtype=DT) + 0.05 * torch.randn(4, dtype=DT), torch.zeros(2, 3, dtype=DT)]


def ratio(num, den):
    return num / den if num > 0 and den > 0 else 1.0


def lamb(ps, grads, o):
    st = [dict(m=torch.zeros_like(p), v=torch.zeros_like(p), t=0) for p in ps]
    out = []
    for gs in grads:
        for p, g, s in zip(ps, gs, st):
            s["t"] += 1
            s["m"] = o["beta1"] * s["m"] + (1 - o["beta1"]) * g
            s["v"] = o["beta2"] * s["v"] + (1 - o["beta2"]) * g * g
            mh = s["m"] / (1 - o["beta1"] ** s["t"])
            vh = s["v"] / (1 - o["beta2"] ** s["t"])
            u = mh / (vh.sqrt() + o["eps"])
            adapt = p.dim() > 1 or o["adapt_vectors"]
            if adapt:
                u = u + o["weight_decay"] * p
                r = ratio(p.norm().item(), u.norm().item())
            else:
                r = 1.0
            p -= o["lr"] * r * u
        out.append(dict(params=[p.clone() for p in ps],
                        exp_avg=[s["m"].clone() for s in st], exp_avg_sq=[s["v"].clone() for s in st]))
    return out


def lars(ps, grads, o):
    bufs = [None] * len(ps)
    out = []
    for gs in grads:
        for i, (p, g) in enumerate(zip(ps, gs)):
            adapt = p.dim() > 1 or o["adapt_vectors"]
            wd = o["weight_decay"] if adapt else 0.0
            if adapt:
                wn, gn = p.norm().item(), g.norm().item()
                local = ratio(o["trust_coefficient"] * wn, gn + wd * wn + o["eps"])
            else:
                local = 1.0
            d = o["lr"] * local * (g + wd * p)
            if o["momentum"] == 0:
                p -= d
                continue
            bufs[i] = d.clone() if bufs[i] is None else o["momentum"] * bufs[i] + d
            p -= bufs[i]
        out.append(dict(params=[p.clone() for p in ps],
                        momentum_buffer=[b.clone() for b in bufs] if o["momentum"] != 0 else []))
    return out


def case(name, kind, o, steps=3):
    ps = params()
    init = [p.clone() for p in ps]
    grads = [[torch.randn_like(p) for p in ps] for _ in range(steps)]
    after = (lamb if kind == "lamb" else lars)(ps, grads, o)
    flat = lambda ts: [t.flatten().tolist() for t in ts]
    return dict(name=name, kind=kind, options=o, shapes=[list(p.shape) for p in init], init=flat(init),
                grads=[flat(g) for g in grads],
                steps=[{k: flat(v) for k, v in s.items()} for s in after])


base = dict(lr=0.01, momentum=0.0, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.1, trust_coefficient=0.001,
            adapt_vectors=False)
cases = [
    case("lamb", "lamb", base),
    case("lamb_no_decay", "lamb", dict(base, weight_decay=0.0, beta1=0.8, beta2=0.95)),
    case("lamb_adapt_vectors", "lamb", dict(base, adapt_vectors=True)),
    case("lars", "lars", dict(base, lr=0.5, momentum=0.9, weight_decay=0.01, trust_coefficient=0.02, eps=1e-8)),
    case("lars_no_momentum", "lars", dict(base, lr=0.5, weight_decay=0.05, trust_coefficient=0.02, eps=1e-8)),
    case("lars_adapt_vectors", "lars",
         dict(base, lr=0.5, momentum=0.9, weight_decay=0.01, trust_coefficient=0.02, eps=1e-8, adapt_vectors=True)),
]
here = os.path.dirname(os.path.abspath(__file__))
path = os.path.join(here, "..", "data", "optim", "layerwise_reference.json")
with open(path, "w") as f:
    json.dump(dict(generator="tests/unit/layerwise_reference.py", torch=torch.__version__, cases=cases), f)
print("wrote", os.path.normpath(path))
