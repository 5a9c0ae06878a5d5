#!/usr/bin/env bash
# Data at scale: a 2 GB synthetic JSON lines corpus (tests/e2e/synthetic_jsonl.py, in a temporary
# directory removed on exit) preprocessed with `tandem preprocess` and trained on for a few steps
# by 2 workers reading it by mmap: the peak resident memory of the preprocess process and of each
# training rank (the report's, which counts the mapped pages read) stays under 1 GiB, and the
# dataset's token count is the one the preprocess reported. Prints each phase's wall time.
# usage: hf_packed_2gb.sh TANDEM SOURCE_DIR [BYTES]
set -uo pipefail
tandem=$1
src=$2
bytes=${3:-2000000000}
. "$src/tests/e2e/hf_lib.sh"
limit=$((1024 * 1024 * 1024))
fails=0
t0=$SECONDS
"$py" "$src/tests/e2e/synthetic_jsonl.py" "$tmp/big.jsonl" "$bytes" || exit 1
echo "generated in $((SECONDS - t0)) s"
t0=$SECONDS
# The preprocess's peak resident memory: getrusage of the child once it has exited.
"$py" - "$tandem" "$tmp" <<'PY' || fails=$((fails + 1))
import resource, subprocess, sys
tandem, tmp = sys.argv[1:3]
r = subprocess.run([tandem, "preprocess", "--init-from", f"{tmp}/fx/lm", "--data", f"{tmp}/big.jsonl", "--out",
                    f"{tmp}/d", "--threads", "2", "--no-progress"], capture_output=True, text=True)
print(r.stdout, r.stderr, end="")
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
ok = r.returncode == 0 and peak < 1 << 30
print(f"{'ok  ' if ok else 'FAIL'} preprocess: exit {r.returncode}, peak resident {peak / 2**20:.0f} MiB (limit 1024)")
sys.exit(0 if ok else 1)
PY
echo "preprocessed in $((SECONDS - t0)) s"
rm -f "$tmp/big.jsonl"
t0=$SECONDS
run train -n 2 --init-from "$tmp/fx/lm" --data "$tmp/d" --seq 128 --batch 8 --steps 5 --lr 1e-3
echo "trained in $((SECONDS - t0)) s"
"$py" - "$tmp/train.jsonl" "$tmp/d/dataset.json" "$limit" <<'PY' || fails=$((fails + 1))
import json, sys
report = [json.loads(l) for l in open(sys.argv[1]) if '"report"' in l][-1]
info = json.load(open(sys.argv[2]))
peaks, limit = report["peak_rss_bytes"], int(sys.argv[3])
ok = len(peaks) == 2 and max(peaks) < limit and info["tokens"] > 0
print(f"{'ok  ' if ok else 'FAIL'} training on {info['tokens']} tokens ({info['documents']} documents): peak resident "
      f"{', '.join(f'{p / 2**20:.0f}' for p in peaks)} MiB per rank (limit {limit / 2**20:.0f})")
sys.exit(0 if ok else 1)
PY
[ "$fails" -eq 0 ] || { echo "$fails check(s) failed"; exit 1; }
echo "the corpus of $bytes bytes preprocessed and trained on in bounded memory"
