#!/usr/bin/env python3
"""How long this machine's speed holds, and whether its cores move together: the measurement
behind the calibration's timing of every point for at least 0.3 s (docs/BENCHMARKS.md, "Planning").

  run:  .venv/bin/python bench/host_speed_probe.py run SECONDS OUT.json
        (start one per core at once: ... run 150 a.json & ... run 150 b.json; wait)
  eval: python3 bench/host_speed_probe.py eval a.json [b.json]

`run` times four one-thread 384x384 GEMMs back to back for SECONDS and keeps (wall time,
seconds) of every group. `eval` bins them into 0.25 s and 1 s windows and prints the spread of
the windows' median time (sd of its log), its autocorrelation at lags of 0.25-40 s, and the
correlation of two probes' windows taken at once. A speed that holds for seconds could be
corrected by a probe timed just before each run; one that forgets within a second, and moves
each core on its own, can only be averaged out by timing for longer.
"""
import json
import math
import statistics as st
import sys
import time


def run(seconds, out):
    import torch
    torch.set_num_threads(1)
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    samples, t_end = [], time.time() + seconds
    while time.time() < t_end:
        t0 = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        samples.append((time.time(), time.perf_counter() - t0))
    json.dump(samples, open(out, "w"))


def windows(path, w):
    d = json.load(open(path))
    t0, bins = d[0][0], {}
    for t, x in d:
        bins.setdefault(int((t - t0) / w), []).append(x)
    keys = sorted(bins)[1:-1]  # the first and last windows are partial
    return {k: math.log(st.median(bins[k])) for k in keys}


def corr(x, y):
    mx, my, sx, sy = st.mean(x), st.mean(y), st.pstdev(x), st.pstdev(y)
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / len(x) / sx / sy


def evaluate(paths):
    for w in (0.25, 1.0):
        a = windows(paths[0], w)
        keys = sorted(a)
        v = [a[k] for k in keys]
        print("window %.2f s: sd of log time %.3f, median time %.2f..%.2f ms" %
              (w, st.pstdev(v), 1e3 * math.exp(min(v)), 1e3 * math.exp(max(v))))
        for lag in (1, 2, 4, 8, 16, 40):
            x = [a[k] for k in keys if k + lag in a]
            y = [a[k + lag] for k in keys if k + lag in a]
            if len(x) > 2:
                print("  lag %5.2f s: autocorrelation %.2f" % (lag * w, corr(x, y)))
        if len(paths) > 1:
            b = windows(paths[1], w)
            both = [k for k in keys if k in b]
            print("  the two probes, same window: correlation %.2f" % corr([a[k] for k in both], [b[k] for k in both]))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "run":
        run(float(sys.argv[2]), sys.argv[3])
    elif len(sys.argv) in (3, 4) and sys.argv[1] == "eval":
        evaluate(sys.argv[2:])
    else:
        sys.exit(__doc__)
