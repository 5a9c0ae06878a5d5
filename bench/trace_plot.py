#!/usr/bin/env python3
"""Draws a window of a `tandem train --trace` timeline as a PNG with gnuplot: one row per rank
and thread, one bar per event, coloured by category (compute, communication, wait, data,
checkpoint). For the docs; the JSON itself opens in Perfetto (ui.perfetto.dev) or
chrome://tracing.

usage: bench/trace_plot.py TRACE.json OUT.png [--from-ms A] [--to-ms B]
"""
import argparse, json, os, subprocess, sys, tempfile

COLOURS = {"compute": "#4c72b0", "communication": "#dd8452", "wait": "#c44e52", "data": "#55a868",
           "checkpoint": "#8172b3"}

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("out")
    ap.add_argument("--from-ms", type=float, default=None)
    ap.add_argument("--to-ms", type=float, default=None)
    a = ap.parse_args()
    ev = json.load(open(a.trace))["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = [e for e in ev if e["ph"] == "X"]
    lo = a.from_ms if a.from_ms is not None else min(e["ts"] for e in spans) / 1e3
    hi = a.to_ms if a.to_ms is not None else max(e["ts"] + e["dur"] for e in spans) / 1e3
    spans = [e for e in spans if e["ts"] / 1e3 < hi and (e["ts"] + e["dur"]) / 1e3 > lo]
    tracks = sorted({(e["pid"], e["tid"]) for e in spans}, key=lambda t: (t[0], names.get(t, "") != "main", t[1]))
    row = {t: i for i, t in enumerate(tracks)}
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "bars.dat")
        with open(data, "w") as f:
            for cat in COLOURS:
                f.write(f"# {cat}\n")
                for e in spans:
                    if e["cat"] != cat:
                        continue
                    x0, x1 = max(lo, e["ts"] / 1e3), min(hi, (e["ts"] + e["dur"]) / 1e3)
                    y = len(tracks) - 1 - row[(e["pid"], e["tid"])]
                    f.write(f"{(x0 + x1) / 2} {y} {(x1 - x0) / 2} 0.35\n")
                f.write("\n\n")
        labels = ", ".join(f'"rank {p}: {names.get((p, t), t)}" {len(tracks) - 1 - i}'
                           for i, (p, t) in enumerate(tracks))
        plots = ", ".join(f"'{data}' index {i} using 1:2:3:4 with boxxyerror fs solid 0.9 noborder "
                          f"lc rgb '{c}' title '{cat}'" for i, (cat, c) in enumerate(COLOURS.items()))
        script = f"""set terminal pngcairo size 1400,{160 + 46 * len(tracks)} font ",11"
set output '{a.out}'
set xlabel 'milliseconds since the trace started'
set ytics ({labels})
set yrange [-0.7:{len(tracks) - 0.3}]
set xrange [{lo}:{hi}]
set key outside top center horizontal
set grid xtics
plot {plots}
"""
        subprocess.run(["gnuplot"], input=script, text=True, check=True)
    print(f"wrote {a.out}: {len(spans)} events on {len(tracks)} tracks, {lo:.1f}-{hi:.1f} ms")

if __name__ == "__main__":
    sys.exit(main())
