"""Checks a --tensorboard directory against the --metrics file of the same run, reading the
events with TensorBoard's own EventAccumulator: one event file named events.out.tfevents.<time>.<host>
starting with the file version brain.Event:2, every step's figures equal to the metrics line's
(as float32, TensorBoard's scalar type), and the final figures equal to the report line's.

usage: tensorboard_check.py TB_DIR METRICS [--require TAG,...]   (exit 1 naming each mismatch)
       tensorboard_check.py TB_DIR --at-least N                  (a killed run: N whole steps)
"""
import argparse
import json
import os
import re
import struct
import sys

from tensorboard.backend.event_processing import event_accumulator, event_file_loader

STEP_TAGS = ["loss", "lr", "samples_per_second", "grad_norm", "loss_scale", "peak_rss_bytes", "comm_share", "aux_loss",
             "z_loss"]
FINAL_TAGS = ["samples_per_second", "test_accuracy", "eval_loss"]


def f32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


def load(tb_dir):
    files = os.listdir(tb_dir)
    events = [f for f in files if re.fullmatch(r"events\.out\.tfevents\.\d+\.[^/]+", f)]
    if len(events) != 1 or len(files) != 1:
        sys.exit(f"FAIL {tb_dir}: expected one events.out.tfevents.<time>.<host> file, found {files}")
    first = next(iter(event_file_loader.EventFileLoader(os.path.join(tb_dir, events[0])).Load()), None)
    if first is None or first.file_version != "brain.Event:2":
        sys.exit(f"FAIL {tb_dir}: the first event is {first}, expected the file version 'brain.Event:2'")
    acc = event_accumulator.EventAccumulator(tb_dir, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tb_dir")
    ap.add_argument("metrics", nargs="?")
    ap.add_argument("--require", default="")
    ap.add_argument("--at-least", type=int, default=0)
    a = ap.parse_args()
    scalars = load(a.tb_dir)
    if a.at_least:
        steps = sorted(scalars.get("train/loss", {}))
        if len(steps) < a.at_least or steps != list(range(1, len(steps) + 1)):
            sys.exit(f"FAIL {a.tb_dir}: train/loss at steps {steps}, expected 1.. at least {a.at_least}")
        print(f"ok   {a.tb_dir}: steps 1..{len(steps)} readable")
        return
    lines = [json.loads(l) for l in open(a.metrics)]
    report, per_step = lines[-1], lines[:-1]
    assert report.get("report") is True, "the metrics file's last line is not the report"
    bad = []
    want_tags = set()
    for line in per_step:
        for name in STEP_TAGS:
            tag = "train/" + name
            if name not in line:
                if line["step"] in scalars.get(tag, {}):
                    bad.append(f"{tag} at step {line['step']} is not in the metrics file")
                continue
            want_tags.add(tag)
            got = scalars.get(tag, {}).get(line["step"])
            if got is None or got != f32(line[name]):
                bad.append(f"{tag} step {line['step']}: tensorboard {got}, metrics {line[name]}")
    last = per_step[-1]["step"] if per_step else 0
    for name in FINAL_TAGS:
        tag = "final/" + name
        if report.get(name, -1) < 0:
            continue
        want_tags.add(tag)
        got = scalars.get(tag, {}).get(last)
        if got is None or got != f32(report[name]):
            bad.append(f"{tag} at step {last}: tensorboard {got}, report {report[name]}")
    extra = set(scalars) - want_tags
    if extra:
        bad.append(f"tags in the events but not in the metrics: {sorted(extra)}")
    if len(scalars.get("train/loss", {})) != len(per_step):
        bad.append(f"{len(scalars.get('train/loss', {}))} train/loss steps, {len(per_step)} metrics lines")
    for tag in filter(None, a.require.split(",")):
        if tag not in scalars:
            bad.append(f"required tag {tag} missing (have {sorted(scalars)})")
    for b in bad:
        print("FAIL " + b)
    if bad:
        sys.exit(1)
    print(f"ok   {a.tb_dir}: {len(per_step)} steps x {len(want_tags)} tags equal the metrics")


if __name__ == "__main__":
    main()
