#!/usr/bin/env bash
# `tandem train --pp 2 --pipeline-schedule interleaved --virtual-stages 2` (each rank holds two
# non-adjacent chunks of the MLP's layers) against one worker: the same per-step losses within
# 1e-5 relative over 16 steps (float32; only the order of sums differs), and so do 2 replicas x
# 2 stages with ZeRO-1 or ZeRO-3 over the replicas, or tp 2 x 2 stages (4 workers). Its checkpoint at step 8
# names the whole model's layers, so it resumes on one worker and as a plain 1F1B pipeline, and
# both continue as the one-worker run does; so does tp 2 x 2 stages' checkpoint on one worker. The report names the virtual stages and the bubble
# against (pp-1)/(m*v), and each stage holds as many micro-batches as Megatron's warm-up says. The zero-bubble
# schedules zb-h1 and zb-v (2 stages; zb-v's V of two chunks per rank, with ZeRO-2 over 2 replicas and with tp 2) match one
# worker the same way, and the report gives their bubble against (pp-1)/(3m) and (pp-1)/(6m). Bad combinations fail
# at start, non-zero, naming the options.
# usage: train_interleaved.sh TANDEM
set -uo pipefail
tandem=$1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
common=(--model mlp --batch 64 --optimizer adamw --lr 0.001 --seed 5 --max-steps 16 --no-eval
        --no-baseline --no-progress --threads 1)
fails=0
fail() { echo "FAIL $*"; fails=$((fails + 1)); }
run() {  # run NAME ARGS...
  local name=$1; shift
  timeout 120 "$tandem" train "${common[@]}" --metrics "$out/$name.jsonl" "$@" >"$out/$name.log" 2>&1 ||
    { fail "$name: tandem train $* exited non-zero:"; tail -20 "$out/$name.log"; }
}

run single -n 1 --strategy single
run il -n 2 --pp 2 --micro-batches 4 --pipeline-schedule interleaved --virtual-stages 2 --checkpoint-every 8 --checkpoint-dir "$out/il"
run il_dp2_zero1 -n 4 --pp 2 --micro-batches 4 --pipeline-schedule interleaved --virtual-stages 2 --strategy zero1
run il_dp2_zero3 -n 4 --pp 2 --micro-batches 4 --pipeline-schedule interleaved --virtual-stages 2 --strategy zero3
# tp 2 x 2 stages x 2 chunks: each rank's pieces (its tp blocks of two non-adjacent chunks) are
# checkpointed, and the checkpoint resumes on one worker.
run il_tp2 -n 4 --tp 2 --pp 2 --micro-batches 4 --pipeline-schedule interleaved --virtual-stages 2 \
  --checkpoint-every 8 --checkpoint-dir "$out/il_tp2"
run zbh1 -n 2 --pp 2 --micro-batches 4 --pipeline-schedule zb-h1
run zbv -n 2 --pp 2 --micro-batches 4 --pipeline-schedule zb-v
run zbv_dp2_zero2 -n 4 --pp 2 --micro-batches 4 --pipeline-schedule zb-v --strategy zero2
run zbv_tp2 -n 4 --tp 2 --pp 2 --micro-batches 4 --pipeline-schedule zb-v  # tensor-parallel linears defer too
for re in '^pipeline +2 stages x 2 virtual stages \(a V: rank r holds r and 2pp-1-r\), .*, 4 micro-batches, zb-v' \
          '^bubble +[0-9.]+ idle/compute measured .*theory \(pp-1\)/\(6m\) = 0\.04'; do
  grep -qE -- "$re" "$out/zbv.log" || fail "zb-v report: no line matches /$re/"
done
grep -qE -- '^bubble +[0-9.]+ idle/compute measured .*theory \(pp-1\)/\(3m\) = 0\.08' "$out/zbh1.log" ||
  fail "zb-h1 report: no bubble line against (pp-1)/(3m)"
for re in '^pipeline +2 stages x 2 virtual stages .*, layers per virtual stage [0-9]+/[0-9]+/[0-9]+/[0-9]+, 4 micro-batches, interleaved' \
          '^bubble +[0-9.]+ idle/compute measured .*theory \(pp-1\)/\(m\*v\) = 0\.1[23]'; do
  grep -qE -- "$re" "$out/il.log" || fail "report: no line matches /$re/"
done
for d in one pp; do mkdir -p "$out/$d" && cp -r "$out/il/step-00000008" "$out/$d/"; done
run one -n 1 --strategy single --checkpoint-dir "$out/one" --resume
mkdir -p "$out/tp_one" && cp -r "$out/il_tp2/step-00000008" "$out/tp_one/"
run tp_one -n 1 --strategy single --checkpoint-dir "$out/tp_one" --resume
run pp -n 2 --pp 2 --micro-batches 4 --pipeline-schedule 1f1b --checkpoint-dir "$out/pp" --resume

python3 - "$out" <<'PY' || fails=$((fails + 1))
import json, sys
out = sys.argv[1]
def steps(name):
    try:
        return {d["step"]: d["loss"] for d in map(json.loads, open(f"{out}/{name}.jsonl")) if not d.get("report")}
    except FileNotFoundError:
        return {}
ref, ok = steps("single"), True
for name, first in (("il", 1), ("il_dp2_zero1", 1), ("il_dp2_zero3", 1), ("il_tp2", 1), ("one", 9), ("pp", 9),
                    ("tp_one", 9), ("zbh1", 1), ("zbv", 1), ("zbv_dp2_zero2", 1),
                    ("zbv_tp2", 1)):
    got = steps(name)
    want = list(range(first, 17))
    if sorted(got) != want or sorted(ref) != list(range(1, 17)):
        print(f"FAIL {name}: steps {sorted(got)}, expected {want}"); ok = False; continue
    worst = max(abs(got[s] - ref[s]) / abs(ref[s]) for s in want)
    print(f"{name}: steps {first}-16, worst relative loss difference from one worker {worst:.2e}")
    if worst > 1e-5:
        print(f"FAIL {name}: {worst:.2e} > 1e-5"); ok = False
# Megatron's warm-up, (pp - r - 1) * 2 + (v - 1) * pp forwards, and one more alive: 5 on rank 0, 3 on rank 1.
rep = [d for d in map(json.loads, open(f"{out}/il.jsonl")) if d.get("report")]
live = rep[0].get("peak_live_micro_batches") if rep else None
print(f"il: most micro-batches alive per stage {live}")
if live != [5, 3]:
    print("FAIL il: expected [5, 3] micro-batches alive per stage"); ok = False
sys.exit(0 if ok else 1)
PY

refused() {  # refused NAME NEEDLE ARGS...: exits non-zero at start and says NEEDLE
  local name=$1 needle=$2; shift 2
  if timeout 60 "$tandem" train "${common[@]}" "$@" >"$out/$name.log" 2>&1; then
    fail "$name: tandem train $* was accepted"
  elif ! grep -qF -- "$needle" "$out/$name.log"; then
    fail "$name: no '$needle' in:"; tail -5 "$out/$name.log"
  fi
}
refused v_1f1b "--virtual-stages 2 needs --pipeline-schedule interleaved" -n 2 --pp 2 --micro-batches 4 --virtual-stages 2
refused m_odd "--micro-batches must be a multiple of --pp" -n 2 --pp 2 --pipeline-schedule interleaved \
  --virtual-stages 2 --micro-batches 3
refused v_zero "--virtual-stages 0: give 1 or more" -n 2 --pp 2 --micro-batches 4 --pipeline-schedule interleaved --virtual-stages 0
refused v_many "more virtual stages than the" -n 2 --pp 2 --micro-batches 4 --pipeline-schedule interleaved --virtual-stages 40
refused pp1 "needs --pp 2 or more" -n 1 --strategy single --pipeline-schedule interleaved --virtual-stages 2
refused zbv_chunks "zb-v runs two model chunks per rank" -n 2 --pp 2 --micro-batches 4 --pipeline-schedule zb-v \
  --virtual-stages 3
refused zbh1_chunks "--virtual-stages 2 needs --pipeline-schedule interleaved" -n 2 --pp 2 --micro-batches 4 \
  --pipeline-schedule zb-h1 --virtual-stages 2
refused zbv_pp1 "--pipeline-schedule zb-v needs --pp 2 or more" -n 1 --strategy single --pipeline-schedule zb-v
refused zb_unknown "use gpipe, 1f1b, interleaved, zb-h1 or zb-v" -n 2 --pp 2 --pipeline-schedule zb-h2
[[ $fails -eq 0 ]] && echo "interleaved ok" || { echo "$fails failure(s)"; exit 1; }
