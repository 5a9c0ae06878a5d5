#!/usr/bin/env python3
"""The examples' training in plain PyTorch (run in .venv-hf), the reference their runs are compared
with (tests/package/*.sh, compare_losses.py): the same model built in the same order from
torch.manual_seed(SEED), the same Fashion-MNIST normalisation, the same global batches (Tandem's
DistributedSampler order: its own permutation, a Fisher-Yates shuffle drawing from
std::mt19937_64, reimplemented here), cross-entropy and SGD with momentum 0.9. Prints
`step N loss X` per step, as the examples do.

reference_train.py resnet_engine|custom_loop_ddp --steps N --batch B --lr LR --seed S [--data DIR]
"""
import argparse
import gzip
import os

import torch
from torch import nn

MASK64 = (1 << 64) - 1


class MT19937_64:
    """std::mt19937_64 (its output sequence is fixed by the C++ standard)."""

    def __init__(self, seed):
        self.mt = [seed & MASK64]
        for i in range(1, 312):
            prev = self.mt[-1]
            self.mt.append((6364136223846793005 * (prev ^ (prev >> 62)) + i) & MASK64)
        self.index = 312

    def _twist(self):
        mt = self.mt
        for i in range(312):
            x = (mt[i] & 0xFFFFFFFF80000000) | (mt[(i + 1) % 312] & 0x7FFFFFFF)
            xa = x >> 1
            if x & 1:
                xa ^= 0xB5026F5AA96619E9
            mt[i] = mt[(i + 156) % 312] ^ xa
        self.index = 0

    def __call__(self):
        if self.index >= 312:
            self._twist()
        y = self.mt[self.index]
        self.index += 1
        y ^= (y >> 29) & 0x5555555555555555
        y ^= (y << 17) & 0x71D67FFFEDA60000
        y ^= (y << 37) & 0xFFF7EEE000000000
        y ^= y >> 43
        return y & MASK64


def permutation(n, seed):
    """tandem::data::permutation: Fisher-Yates from the end, bounded draws by rejection."""
    p = list(range(n))
    gen = MT19937_64(seed)
    for i in range(n - 1, 0, -1):
        bound = i + 1
        threshold = (1 << 64) % bound
        r = gen()
        while r < threshold:
            r = gen()
        j = r % bound
        p[i], p[j] = p[j], p[i]
    return p


def load_fashion_mnist(directory):
    """The training split as Tandem loads it: (x / 255 - 0.2860) / 0.3530, float32 [N, 1, 28, 28]."""
    def read(stem):
        path = os.path.join(directory, stem)
        raw = gzip.open(path + ".gz").read() if os.path.exists(path + ".gz") else open(path, "rb").read()
        return bytearray(raw)
    images, labels = read("train-images-idx3-ubyte"), read("train-labels-idx1-ubyte")
    n = int.from_bytes(images[4:8], "big")
    x = torch.frombuffer(images[16:], dtype=torch.uint8).reshape(n, 1, 28, 28)
    y = torch.frombuffer(labels[8:], dtype=torch.uint8).to(torch.int64)
    return x.to(torch.float32).div_(255.0).sub_(0.2860).div_(0.3530), y


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class ResidualMlp(nn.Module):
    """examples/resnet_engine's model. Its C++ constructor makes stem and head first, then the
    blocks (in its body): the same order of draws from the generator here."""

    def __init__(self, width=128, depth=3):
        super().__init__()
        self.stem, self.head = nn.Linear(28 * 28, width), nn.Linear(width, 10)
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])

    def forward(self, x):
        x = torch.relu(self.stem(x.flatten(1)))
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class SmallCnn(nn.Module):
    """examples/custom_loop_ddp's model."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 8, 3, stride=2), nn.Conv2d(8, 16, 3, stride=2)
        self.fc = nn.Linear(16 * 6 * 6, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.conv2(torch.relu(self.conv1(x)))).flatten(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("example", choices=["resnet_engine", "custom_loop_ddp"])
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    model = ResidualMlp() if a.example == "resnet_engine" else SmallCnn()
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    x, y = load_fashion_mnist(a.data)
    order = permutation(len(y), a.seed)
    for step in range(a.steps):
        idx = torch.tensor(order[step * a.batch:(step + 1) * a.batch], dtype=torch.int64)
        loss = nn.functional.cross_entropy(model(x.index_select(0, idx)), y.index_select(0, idx))
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step + 1} loss {loss.item():.8f}", flush=True)


if __name__ == "__main__":
    main()
