#!/usr/bin/env bash
# Data at scale: a synthetic JSON lines corpus (tests/e2e/synthetic_jsonl.py, in a temporary
# directory removed on exit; 2 GB unless BYTES says otherwise) preprocessed with `tandem
# preprocess` and trained on for a few steps by 2 workers reading it by mmap, and the same for a
# 24 MB corpus. Memory is flat in the corpus size: the peak resident memory of the preprocess
# process and of each training rank (the report's, which counts the mapped pages read) exceeds
# the 24 MB corpus's by less than 64 MiB, while the corpus's tokens take several times that, and
# stays under 1 GiB. Prints each phase's wall time.
# usage: hf_packed_2gb.sh TANDEM SOURCE_DIR [BYTES]
set -uo pipefail
tandem=$1
src=$2
bytes=${3:-2000000000}
. "$src/tests/e2e/hf_lib.sh"
fails=0
# corpus TAG BYTES: generate, preprocess into $tmp/TAG (the process's peak resident bytes in
# $tmp/TAG.pre_rss) and train 5 steps on 2 workers (the report in $tmp/TAG_train.jsonl).
corpus() {
  local tag=$1 n=$2 t0=$SECONDS
  "$py" "$src/tests/e2e/synthetic_jsonl.py" "$tmp/$tag.jsonl" "$n" || return 1
  echo "$tag: generated $n bytes in $((SECONDS - t0)) s"
  t0=$SECONDS
  # The preprocess's peak resident memory: getrusage of the child once it has exited.
  "$py" - "$tandem" "$tmp" "$tag" <<'PY' || return 1
import resource, subprocess, sys
tandem, tmp, tag = sys.argv[1:4]
r = subprocess.run([tandem, "preprocess", "--init-from", f"{tmp}/fx/lm", "--data", f"{tmp}/{tag}.jsonl", "--out",
                    f"{tmp}/{tag}", "--threads", "2", "--no-progress"], capture_output=True, text=True)
print(r.stdout, r.stderr, end="")
open(f"{tmp}/{tag}.pre_rss", "w").write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024))
sys.exit(r.returncode)
PY
  echo "$tag: preprocessed in $((SECONDS - t0)) s"
  rm -f "$tmp/$tag.jsonl"
  t0=$SECONDS
  run "${tag}_train" -n 2 --init-from "$tmp/fx/lm" --data "$tmp/$tag" --seq 128 --batch 8 --steps 5 --lr 1e-3 || return 1
  echo "$tag: trained in $((SECONDS - t0)) s"
}
corpus small 24000000 || { echo "FAIL: the 24 MB corpus"; exit 1; }
corpus big "$bytes" || { echo "FAIL: the $bytes-byte corpus"; exit 1; }
"$py" - "$tmp" <<'PY' || fails=$((fails + 1))
import json, os, sys
tmp = sys.argv[1]
slack, limit = 64 << 20, 1 << 30
def peaks(tag):
    report = [json.loads(l) for l in open(f"{tmp}/{tag}_train.jsonl") if '"report"' in l][-1]
    return int(open(f"{tmp}/{tag}.pre_rss").read()), report["peak_rss_bytes"]
info = json.load(open(f"{tmp}/big/dataset.json"))
token_bytes = os.path.getsize(f"{tmp}/big/text_document.bin")
(pre_s, train_s), (pre_b, train_b) = peaks("small"), peaks("big")
mib = lambda b: f"{b / 2**20:.0f}"
ok = (info["tokens"] > 0 and token_bytes > 3 * slack and len(train_b) == 2 and pre_b - pre_s < slack
      and max(train_b) - max(train_s) < slack and max([pre_b] + train_b) < limit)
print(f"{'ok  ' if ok else 'FAIL'} {info['tokens']} tokens ({info['documents']} documents, {mib(token_bytes)} MiB of ids): "
      f"peak resident of the preprocess {mib(pre_b)} MiB (24 MB corpus: {mib(pre_s)}), of the training ranks "
      f"{', '.join(map(mib, train_b))} MiB (24 MB corpus: {', '.join(map(mib, train_s))}); allowed: "
      f"{mib(slack)} MiB more than the 24 MB corpus's, under {mib(limit)} MiB")
sys.exit(0 if ok else 1)
PY
[ "$fails" -eq 0 ] || { echo "$fails check(s) failed"; exit 1; }
echo "the corpus of $bytes bytes preprocessed and trained on in memory flat in its size"
