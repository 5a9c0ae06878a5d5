#!/usr/bin/env bash
# `tandem train --trace FILE`: the timeline parses as JSON and holds, on every rank, the events a
# reader looks for: forward, backward, the optimizer step, data loading, every collective with
# its size, waits, and the checkpoint's save, write (on the writer thread) and commit; with
# --pp 2, the pipeline's sends and receives; `tandem pretrain --trace` (when the fortunes corpus
# is installed) the same compute, data and collective events. A directory that does not exist is refused before
# training. usage: train_trace.sh TANDEM
set -euo pipefail
tandem=$1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
common=(--max-steps 6 --no-eval --no-baseline --no-progress --threads 1 --batch 64)
"$tandem" train -n 2 "${common[@]}" --checkpoint-every 3 --checkpoint-dir "$out/ck" --checkpoint-async \
  --trace "$out/ddp.json" >"$out/log_ddp" 2>&1 || { cat "$out/log_ddp"; exit 1; }
"$tandem" train -n 2 "${common[@]}" --pp 2 --micro-batches 2 --trace "$out/pp.json" >"$out/log_pp" 2>&1 ||
  { cat "$out/log_pp"; exit 1; }
if [ -d /usr/share/games/fortunes ]; then
  "$tandem" pretrain -n 2 --steps 4 --batch 8 --vocab 200 --d-model 32 --heads 2 --layers 2 --seq 16 --no-eval \
    --no-progress --threads 1 --max-per-label 200 --tokenizer-sentences 500 --out "$out/text_ckpt" \
    --trace "$out/text.json" >"$out/log_text" 2>&1 || { cat "$out/log_text"; exit 1; }
fi
python3 - "$out" <<'PY'
import collections, json, sys
out = sys.argv[1]
def check(name, want):
    ev = json.load(open(f"{out}/{name}.json"))["traceEvents"]
    ranks = {e["pid"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert ranks == {0, 1}, f"{name}: ranks {ranks}"
    ok = True
    for r in sorted(ranks):
        got = collections.Counter(e["name"] for e in ev if e["ph"] == "X" and e["pid"] == r)
        for w, least in want.items():
            if got[w] < least:
                print(f"{name} rank {r}: {got[w]} '{w}' events, expected at least {least}; got {dict(got)}")
                ok = False
        for e in ev:
            if e["ph"] == "X" and e["pid"] == r and e["cat"] == "communication" and e["args"].get("bytes", -1) < 0:
                print(f"{name} rank {r}: {e} has no size"); ok = False
            if e["ph"] == "X" and (e["dur"] < 0 or e["ts"] < 0):
                print(f"{name}: negative time in {e}"); ok = False
        threads = {e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == r}
        print(f"{name} rank {r}: {sum(got.values())} events, threads {sorted(threads)}")
    return ok, ev
ok1, ev = check("ddp", {"forward": 6, "backward": 6, "optimizer step": 6, "data": 6, "allreduce": 6, "wait": 1,
                        "checkpoint save": 2, "checkpoint write": 2, "checkpoint commit": 2})
writer = {(e["pid"], e["tid"]) for e in ev if e["ph"] == "M" and e["name"] == "thread_name"
          and e["args"]["name"] == "checkpoint writer"}
main = {(e["pid"], e["tid"]) for e in ev if e["ph"] == "M" and e["name"] == "thread_name" and e["args"]["name"] == "main"}
wrote_on = {(e["pid"], e["tid"]) for e in ev if e["ph"] == "X" and e["name"] == "checkpoint write"}
if not wrote_on <= writer or wrote_on & main:
    print("the asynchronous writes are not on the writer threads:", wrote_on, writer); ok1 = False
ok2, _ = check("pp", {"pipeline forward and backward": 6, "send": 6, "recv": 6, "optimizer step": 6, "data": 6})
ok3 = True
try:
    ok3, _ = check("text", {"forward": 4, "backward": 4, "optimizer step": 4, "data": 4, "allreduce": 4})
except FileNotFoundError:
    print("text: no fortunes corpus, not traced")
sys.exit(0 if ok1 and ok2 and ok3 else 1)
PY
if "$tandem" train -n 1 "${common[@]}" --trace /nonexistent/dir/t.json >"$out/log_bad" 2>&1; then
  echo "--trace into a missing directory was accepted"; exit 1
fi
grep -q "trace /nonexistent/dir/t.json: the directory '/nonexistent/dir' does not exist" "$out/log_bad" ||
  { cat "$out/log_bad"; exit 1; }
echo "trace ok"
