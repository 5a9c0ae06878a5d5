"""Writes a synthetic JSON lines corpus of about SIZE bytes: {"text": ...} lines, each one to four
fortune cookies (Debian's fortunes, the fixture tokenizer's own kind of text) drawn by a seeded
generator. usage: synthetic_jsonl.py OUT SIZE_BYTES"""
import json
import os
import random
import sys

root, out, size = "/usr/share/games/fortunes", sys.argv[1], int(sys.argv[2])
docs = []
for name in sorted(os.listdir(root)):
    p = os.path.join(root, name)
    if os.path.isfile(p) and not os.path.islink(p) and not name.endswith((".dat", ".u8")):
        docs += [d.strip() for d in open(p, encoding="utf-8", errors="replace").read().split("\n%\n") if d.strip()]
rng = random.Random(0)
lines = []
for _ in range(20000):
    lines.append(json.dumps({"text": "\n\n".join(rng.choice(docs) for _ in range(rng.randint(1, 4)))}) + "\n")
written = 0
with open(out, "w") as f:
    while written < size:
        block = "".join(rng.choices(lines, k=2000))
        f.write(block)
        written += len(block.encode())
print(f"wrote {out}: {written} bytes")
