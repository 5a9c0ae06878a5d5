"""Cross-check of Tandem's safetensors reader and writer against the Python reference
(safetensors.torch, huggingface_hub), run by tests/unit/test_safetensors.cpp in .venv-hf.

  st_crosscheck.py make DIR    writes DIR/py.safetensors (safetensors.torch.save_file, with
                               metadata), DIR/py_sharded/ (huggingface_hub.save_torch_state_dict,
                               several shards) and, for an independent reading, every tensor's raw
                               little-endian bytes as DIR/raw/<name>.bin with DIR/raw/shapes.json
  st_crosscheck.py check DIR   loads what Tandem wrote, DIR/cc.safetensors and DIR/cc_sharded/,
                               and compares with the same tensors bit for bit; exit 1 on a mismatch
"""
import json
import os
import sys

import torch
from huggingface_hub import save_torch_state_dict
from safetensors import safe_open
from safetensors.torch import load_file, save_file

METADATA = {"format": "pt", "origin": "python", "note": "ünïcode ✓"}


def tensors():
    g = torch.Generator().manual_seed(1234)
    out = {
        "f64": torch.randn(3, 5, generator=g, dtype=torch.float64),
        "f32": torch.randn(7, 3, 2, generator=g),
        "f16": torch.randn(5, 9, generator=g).half(),
        "bf16": torch.randn(11, generator=g).bfloat16(),
        "i64": torch.randint(-(2**62), 2**62, (4, 3), generator=g, dtype=torch.int64),
        "i32": torch.randint(-(2**31), 2**31 - 1, (13,), generator=g, dtype=torch.int32),
        "i16": torch.randint(-(2**15), 2**15 - 1, (3, 3), generator=g, dtype=torch.int16),
        "i8": torch.randint(-128, 127, (17,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (2, 7), generator=g, dtype=torch.uint8),
        "bool": torch.rand(9, generator=g) > 0.5,
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "model.layers.0.w": torch.randn(64, 33, generator=g),
    }
    out["f32"][0, 0, 0] = float("nan")
    out["f16"][0, 0] = float("-inf")
    return out


def bits(t):
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def make(d):
    ts = tensors()
    save_file(ts, os.path.join(d, "py.safetensors"), metadata=METADATA)
    os.makedirs(os.path.join(d, "py_sharded"), exist_ok=True)
    save_torch_state_dict(ts, os.path.join(d, "py_sharded"), max_shard_size=2000, metadata={"format": "pt"})
    os.makedirs(os.path.join(d, "raw"), exist_ok=True)
    shapes = {}
    for name, t in ts.items():
        bits(t).numpy().tofile(os.path.join(d, "raw", name + ".bin"))
        shapes[name] = {"shape": list(t.shape), "dtype": str(t.dtype)}
    with open(os.path.join(d, "raw", "shapes.json"), "w") as f:
        json.dump(shapes, f)


def check(d):
    ts = tensors()
    bad = []
    path = os.path.join(d, "cc.safetensors")
    got = load_file(path)
    with safe_open(path, "pt") as f:
        if f.metadata() != METADATA:
            bad.append(f"metadata {f.metadata()} != {METADATA}")
    sharded = os.path.join(d, "cc_sharded")
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    if len(shards) < 2:
        bad.append(f"cc_sharded has {len(shards)} shard(s)")
    total = 0
    for s in shards:
        part = load_file(os.path.join(sharded, s))
        for name, t in part.items():
            if index["weight_map"].get(name) != s:
                bad.append(f"{name} found in {s}, index says {index['weight_map'].get(name)}")
            total += t.numel() * t.element_size()
            got["sharded/" + name] = t
    if index["metadata"]["total_size"] != total:
        bad.append(f"total_size {index['metadata']['total_size']} != {total}")
    for name, t in ts.items():
        for key in (name, "sharded/" + name):
            if key not in got:
                bad.append(f"{key} missing")
            elif not same(got[key], t):
                bad.append(f"{key} differs: {got[key].dtype} {tuple(got[key].shape)} vs {t.dtype} {tuple(t.shape)}")
    extra = set(got) - set(ts) - {"sharded/" + n for n in ts}
    if extra:
        bad.append(f"unexpected tensors {sorted(extra)}")
    for b in bad:
        print("MISMATCH", b)
    print(f"checked {len(got)} tensors: {'ok' if not bad else 'FAILED'}")
    return 1 if bad else 0


if __name__ == "__main__":
    mode, d = sys.argv[1], sys.argv[2]
    sys.exit(make(d) if mode == "make" else check(d))
