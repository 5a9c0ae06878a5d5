"""Reads the metrics file of `tandem train --metrics FILE` (JSON lines): one line per step,
then the report. For the e2e scripts' checks: import it with sys.path set to tests/e2e."""
import json


def load(path):
    """(per-step losses, the report dict or None) of one metrics file."""
    losses, report = [], None
    for line in open(path):
        d = json.loads(line)
        if d.get("report"):
            report = d
        else:
            losses.append(d["loss"])
    return losses, report
