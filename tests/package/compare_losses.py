#!/usr/bin/env python3
"""Compares the `step N loss X` lines of two runs (optionally prefixed by `[rank R] `).

compare_losses.py REFERENCE RUN --steps FIRST-LAST --tol TOL [--decreasing]

RUN must report exactly the steps FIRST..LAST, each once, and REFERENCE must report them too;
every |loss(RUN) - loss(REFERENCE)| must be <= TOL. --decreasing also requires the last
loss of RUN to be below its first (the run trained). Prints the steps side by side; exits 1 on
any failure, naming it.
"""
import argparse
import re
import sys

LINE = re.compile(r"^(?:\[rank \d+\] )?step (\d+) loss (\S+)$")


def losses(path):
    out = {}
    with open(path) as f:
        for line in f:
            m = LINE.match(line.strip())
            if not m:
                continue
            step = int(m.group(1))
            if step in out:
                sys.exit(f"{path}: step {step} reported twice")
            out[step] = float(m.group(2))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("reference")
    ap.add_argument("run")
    ap.add_argument("--steps", required=True, help="FIRST-LAST")
    ap.add_argument("--tol", type=float, required=True)
    ap.add_argument("--decreasing", action="store_true")
    a = ap.parse_args()
    first, last = (int(x) for x in a.steps.split("-"))
    want = list(range(first, last + 1))
    ref, run = losses(a.reference), losses(a.run)
    if sorted(run) != want:
        sys.exit(f"{a.run}: steps {sorted(run)}, expected {first}..{last}")
    missing = [s for s in want if s not in ref]
    if missing:
        sys.exit(f"{a.reference}: no loss for steps {missing}")
    worst = 0.0
    print(f"{'step':>4} {'reference':>12} {'run':>12} {'|diff|':>10}")
    for s in want:
        d = abs(run[s] - ref[s])
        worst = max(worst, d) if d == d else float("inf")  # NaN counts as infinitely far
        print(f"{s:>4} {ref[s]:>12.8f} {run[s]:>12.8f} {d:>10.2e}")
    failed = False
    if not worst <= a.tol:
        print(f"FAIL: {a.run} differs from {a.reference} by up to {worst:.3e} (tolerance {a.tol:g})")
        failed = True
    if a.decreasing and not run[last] < run[first]:
        print(f"FAIL: {a.run}: the loss did not decrease ({run[first]:.6f} at step {first}, {run[last]:.6f} at {last})")
        failed = True
    if not failed:
        print(f"ok: max |diff| {worst:.3e} <= {a.tol:g}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
