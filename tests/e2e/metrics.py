"""Reads the metrics file of `tandem train --metrics FILE` (JSON lines): one line per step,
then the report, then an elastic run's membership changes. For the e2e scripts' checks: import it with sys.path set to tests/e2e."""
import json


def load(path):
    """(per-step losses, the report dict or None) of one metrics file."""
    losses, report = [], None
    for line in open(path):
        d = json.loads(line)
        if d.get("report"):
            report = d
        elif "membership" in d:  # an elastic run's membership change (tandem/elastic.h)
            continue
        else:
            losses.append(d["loss"])
    return losses, report
