#!/usr/bin/env bash
# `tandem train --tp T --pp P` (tensor and pipeline parallelism, the rest data parallel) against
# one worker with --strategy single: the same seed, global batch, lr and constant schedule must
# give the same per-step losses (within TOL relative; tp and pp only change the order of float32
# sums) for tp 2 x dp 2, pp 2 (GPipe and 1F1B), tp 2 x pp 2, pp 2 x dp 2 with ZeRO-1, 2 and 3 over dp,
# and tp 2 x dp 2 with ZeRO-2 and ZeRO-3 over dp. In bf16 tp 2 x dp 2, pp 2 and tp 2 x pp 2 with ZeRO-1 follow one bf16 worker, and with
# --max-grad-norm tp 2 x dp 2 (DDP, ZeRO-1, ZeRO-2), pp 2, pp 2 x dp 2 (ZeRO-1) and tp 2 x pp 2 one
# clipping worker; in fp16 from a loss scale that overflows tp 2, pp 2 and tp 2 x pp 2 skip the
# same steps as one fp16 worker (pp 2 with ZeRO-1 too), and ZeRO-1 over tp 2 x dp 2 as DDP there. The report
# and the metrics name the layout, every rank's measured activation peak, tandem plan's memory for the
# layout (its parameters equal the measured ones without a pipeline), and the pipeline's bubble next to (pp-1)/m. The CNN cut by
# --pp-partition time and by a list follows one worker too. Bad
# input fails at start, non-zero, with a message naming the problem.
# usage: train_model_parallel.sh TANDEM
set -uo pipefail
tandem=$1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
STEPS=12
common=(--model mlp --batch 64 --lr 0.02 --schedule constant --seed 7 --max-steps $STEPS --no-eval --no-baseline
        --no-progress --threads 1)
fails=0

run() {  # run NAME ARGS...: trains, keeps the log and the metrics
  local name=$1; shift
  local start=$SECONDS
  if ! timeout 120 "$tandem" train "${common[@]}" "$@" --metrics "$out/$name.jsonl" >"$out/$name.log" 2>&1; then
    echo "FAIL $name: tandem train $* exited non-zero; output:"; sed 's/^/    /' "$out/$name.log" | tail -30
    fails=$((fails + 1))
    return
  fi
  echo "ran  $name in $((SECONDS - start)) s: tandem train $*"
}

run single -n 1 --strategy single
run tp2_dp2 -n 4 --tp 2
run pp2_gpipe -n 2 --pp 2 --micro-batches 4 --pipeline-schedule gpipe
run pp2_1f1b -n 2 --pp 2 --micro-batches 4 --pipeline-schedule 1f1b
run tp2_pp2 -n 4 --tp 2 --pp 2 --micro-batches 4
run pp2_dp2_zero1 -n 4 --pp 2 --micro-batches 4 --strategy zero1
run pp2_dp2_zero2 -n 4 --pp 2 --micro-batches 4 --strategy zero2
run pp2_dp2_zero3 -n 4 --pp 2 --micro-batches 4 --strategy zero3
run tp2_dp2_zero2 -n 4 --tp 2 --strategy zero2
run tp2_dp2_zero3 -n 4 --tp 2 --strategy zero3

# The human report of a pipeline run: layout, partition and bubble against theory.
for re in '^layout +dp 1 x tp 1 x pp 2' '^pipeline +2 stages, layers per stage [0-9]+/[0-9]+, 4 micro-batches, 1f1b' \
          '^bubble +[0-9.]+ idle/compute measured .*theory \(pp-1\)/m = 0\.25'; do
  grep -qE -- "$re" "$out/pp2_1f1b.log" || { echo "FAIL report: no line matches /$re/"; fails=$((fails + 1)); }
done
grep -qE -- '^layout +dp 2 x tp 2 x pp 1' "$out/tp2_dp2.log" || { echo "FAIL report: tp2_dp2 has no layout line"; fails=$((fails + 1)); }

TOL=${TANDEM_MP_TOL:-1e-4} python3 - "$out" $STEPS <<'PY' || fails=$((fails + 1))
import json, os, sys
out, steps = sys.argv[1], int(sys.argv[2])
tol = float(os.environ["TOL"])
def load(name):
    losses, rep = [], None
    try:
        for line in open(f"{out}/{name}.jsonl"):
            d = json.loads(line)
            if d.get("report"): rep = d
            else: losses.append(d["loss"])
    except FileNotFoundError:
        return None, None
    return losses, rep
ref, _ = load("single")
if ref is None or len(ref) != steps:
    print("FAIL: the single-worker reference did not run"); sys.exit(1)
layouts = {"tp2_dp2": (2, 2, 1), "pp2_gpipe": (1, 1, 2), "pp2_1f1b": (1, 1, 2), "tp2_pp2": (1, 2, 2),
           "pp2_dp2_zero1": (2, 1, 2), "pp2_dp2_zero2": (2, 1, 2), "pp2_dp2_zero3": (2, 1, 2), "tp2_dp2_zero2": (2, 2, 1), "tp2_dp2_zero3": (2, 2, 1)}
ok = True
for name, (dp, tp, pp) in layouts.items():
    l, r = load(name)
    if l is None:
        ok = False; continue  # already reported
    if len(l) != steps:
        print(f"FAIL {name}: {len(l)} steps, expected {steps}"); ok = False; continue
    worst = max(abs(a - b) / abs(b) for a, b in zip(l, ref))
    print(f"{name}: worst relative loss difference from one worker over {steps} steps: {worst:.2e} "
          f"(first {l[0]:.6f} vs {ref[0]:.6f}, last {l[-1]:.6f} vs {ref[-1]:.6f})")
    if worst > tol:
        print(f"FAIL {name}: {worst:.2e} > {tol:g}"); ok = False
    acts = r.get("peak_activation_bytes", [])
    if len(acts) != dp * tp * pp or min(acts) <= 0:
        print(f"FAIL {name}: measured activation peaks {acts}, expected one positive figure per rank"); ok = False
    plan = r.get("plan_memory_bytes", [])
    if len(plan) != 4 or (pp == 1 and abs(plan[0] - r["parameter_bytes"]) > 0.01 * r["parameter_bytes"]):
        print(f"FAIL {name}: plan's memory {plan} against measured parameters {r['parameter_bytes']}"); ok = False
    # With a pipeline, the plan's figures per stage (for the partition the run used) against every
    # rank's measured parameters on that stage.
    stages, states = r.get("plan_memory_bytes_per_stage", []), r.get("model_state_bytes_per_rank", [])
    if pp > 1 and r.get("pipeline_schedule") != "interleaved":
        on = r.get("pipeline_stage_per_rank", [])
        if len(stages) != pp or len(states) != dp * tp * pp or sorted(set(on)) != list(range(pp)) or any(
                abs(stages[s][0] - st[0]) > 0.01 * st[0] for s, st in zip(on, states)):
            print(f"FAIL {name}: plan per stage {stages} against measured model state {states} on stages {on}")
            ok = False
    if (r["dp"], r["tp"], r["pp"]) != (dp, tp, pp) or r["layout"] != f"dp {dp} x tp {tp} x pp {pp}":
        print(f"FAIL {name}: metrics give layout {r.get('layout')}, expected dp {dp} x tp {tp} x pp {pp}"); ok = False
    if pp > 1:
        theory = (pp - 1) / r["micro_batches"]
        if abs(r["bubble_theory"] - theory) > 1e-12 or len(r["bubble_per_stage"]) != pp or r["bubble_measured"] < 0:
            print(f"FAIL {name}: bubble fields wrong: {r.get('bubble_theory')} {r.get('bubble_per_stage')}"); ok = False
        live = r["peak_live_micro_batches"]
        # GPipe holds all m micro-batches on every stage; 1F1B at most pp - s on stage s.
        want = [r["micro_batches"]] * pp if r["pipeline_schedule"] == "gpipe" else [pp - s for s in range(pp)]
        if live != want:
            print(f"FAIL {name}: micro-batches alive per stage {live}, expected {want}"); ok = False
        print(f"{name}: bubble idle/compute {r['bubble_measured']:.2f} (stages {['%.2f' % b for b in r['bubble_per_stage']]})"
              f" vs theory {theory:.2f}; partition {r['partition']}; alive {live}")
sys.exit(0 if ok else 1)
PY

# bf16 (fp32 masters, no loss scaling): the layouts against one bf16 worker. bf16 rounds each
# product's inputs to 8 significant bits, so a layout's other order of sums shows far above
# float32's; the bound is TOL_BF16 relative, and every run must stay within 2 % of fp32's loss.
run single_bf16 -n 1 --strategy single --precision bf16
run tp2_dp2_bf16 -n 4 --tp 2 --precision bf16
run pp2_bf16 -n 2 --pp 2 --micro-batches 4 --precision bf16
run tp2_pp2_zero1_bf16 -n 4 --tp 2 --pp 2 --micro-batches 4 --strategy zero1 --precision bf16
TOL=${TANDEM_MP_TOL_BF16:-5e-3} python3 - "$out" $STEPS <<'PY' || fails=$((fails + 1))
import json, os, sys
out, steps = sys.argv[1], int(sys.argv[2])
tol = float(os.environ["TOL"])
def load(name):
    try:
        return [d["loss"] for d in map(json.loads, open(f"{out}/{name}.jsonl")) if not d.get("report")], \
               [d for d in map(json.loads, open(f"{out}/{name}.jsonl")) if d.get("report")][0]
    except (FileNotFoundError, IndexError):
        return None, None
ref, _ = load("single_bf16")
fp32, _ = load("single")
if ref is None or fp32 is None or len(ref) != steps:
    print("FAIL: the single-worker references did not run"); sys.exit(1)
ok = True
for name in ("single_bf16", "tp2_dp2_bf16", "pp2_bf16", "tp2_pp2_zero1_bf16"):
    l, r = load(name)
    if l is None or len(l) != steps:
        print(f"FAIL {name}: did not log {steps} steps"); ok = False; continue
    worst = max(abs(a - b) / abs(b) for a, b in zip(l, ref))
    worst32 = max(abs(a - b) / abs(b) for a, b in zip(l, fp32))
    print(f"{name}: worst relative loss difference from one bf16 worker {worst:.2e}, from fp32 {worst32:.2e} "
          f"(last {l[-1]:.5f}; bf16 {ref[-1]:.5f}, fp32 {fp32[-1]:.5f}); report precision {r['precision']}")
    if worst > tol or worst32 > 2e-2 or r["precision"] != "bf16":
        print(f"FAIL {name}"); ok = False
sys.exit(0 if ok else 1)
PY

# fp16 with dynamic loss scaling, started at 2^24 so that the first steps overflow: every stage
# and shard must skip the same steps as one fp16 worker (the overflow check is the global norm's)
# and then follow its losses within 1e-3. One replica each: data-parallel replicas overflow on
# their own half batches, which one worker's whole batch need not (2 DDP workers skip 6 steps
# here where one skips 5), as with PyTorch's DDP and GradScaler.
run f16_single -n 1 --strategy single --precision fp16 --initial-loss-scale 16777216
run f16_tp2 -n 2 --tp 2 --precision fp16 --initial-loss-scale 16777216
run f16_pp2 -n 2 --pp 2 --micro-batches 4 --precision fp16 --initial-loss-scale 16777216
run f16_tp2_pp2 -n 4 --tp 2 --pp 2 --micro-batches 4 --precision fp16 --initial-loss-scale 16777216
# ZeRO-1 on a split model (its overflow check sums its shards over dp, the tp shards over tp,
# the stages over pp): pp 2 as one fp16 worker; over 2 replicas of tp 2 the same skips and
# losses as DDP over them. (Over 2 replicas of pp 2 ZeRO-1 skips as many steps as DDP but not
# the same ones: it sums the replicas' fp16 gradients after each micro-batch, DDP averages after
# the last, so a step near the overflow boundary can go either way.)
run f16_pp2_zero1 -n 2 --pp 2 --micro-batches 4 --strategy zero1 --precision fp16 --initial-loss-scale 16777216
run f16_tp2_dp2 -n 4 --tp 2 --precision fp16 --initial-loss-scale 16777216
run f16_tp2_dp2_zero1 -n 4 --tp 2 --strategy zero1 --precision fp16 --initial-loss-scale 16777216
python3 - "$out" $STEPS <<'PY' || fails=$((fails + 1))
import json, sys
out, steps = sys.argv[1], int(sys.argv[2])
def load(name):
    try:
        rows = [json.loads(l) for l in open(f"{out}/{name}.jsonl")]
    except FileNotFoundError:
        return None, None
    return [d["loss"] for d in rows if not d.get("report")], next((d for d in rows if d.get("report")), None)
ref, rr = load("f16_single")
if ref is None or len(ref) != steps or rr is None:
    print("FAIL: the fp16 single-worker reference did not run"); sys.exit(1)
ok = 0 < rr["skipped_steps"] < steps
print(f"f16_single: {rr['skipped_steps']} step(s) skipped, loss scale {rr['loss_scale']:g}" + ("" if ok else " FAIL (want some)"))
for name in ("f16_tp2", "f16_pp2", "f16_tp2_pp2", "f16_pp2_zero1"):
    l, r = load(name)
    if l is None or len(l) != steps or r is None:
        print(f"FAIL {name}: did not log {steps} steps"); ok = False; continue
    worst = max(abs(a - b) / abs(b) for a, b in zip(l, ref))
    same = (r["skipped_steps"], r["loss_scale"]) == (rr["skipped_steps"], rr["loss_scale"])
    print(f"{name}: {r['skipped_steps']} skipped, scale {r['loss_scale']:g}; worst relative loss difference {worst:.2e}")
    if worst > 1e-3 or not same:
        print(f"FAIL {name}"); ok = False
for name, ddp in (("f16_tp2_dp2_zero1", "f16_tp2_dp2"),):
    l, r = load(name)
    d, dr = load(ddp)
    if l is None or d is None or len(l) != steps or len(d) != steps or r is None or dr is None:
        print(f"FAIL {name} or {ddp}: did not log {steps} steps"); ok = False; continue
    worst = max(abs(a - b) / abs(b) for a, b in zip(l, d))
    same = (r["skipped_steps"], r["loss_scale"]) == (dr["skipped_steps"], dr["loss_scale"])
    print(f"{name}: {r['skipped_steps']} skipped, scale {r['loss_scale']:g} ({ddp}: {dr['skipped_steps']}, "
          f"{dr['loss_scale']:g}); worst relative loss difference {worst:.2e}")
    if worst > 1e-3 or not same or not 0 < r["skipped_steps"] < steps:
        print(f"FAIL {name}"); ok = False
sys.exit(0 if ok else 1)
PY

# --max-grad-norm clips by the whole model's gradient norm: the shards' squares summed over tp,
# the stages' over pp. With a bound the gradients exceed at every step, the layouts must follow
# one clipping worker within TOL (each clipping by its own part's norm they missed by 2-4 %), and
# the clipped reference must differ from the unclipped one (the clip is active).
run clip_single -n 1 --strategy single --max-grad-norm 0.3
run clip_tp2_dp2 -n 4 --tp 2 --max-grad-norm 0.3
run clip_pp2 -n 2 --pp 2 --micro-batches 4 --max-grad-norm 0.3
run clip_tp2_pp2 -n 4 --tp 2 --pp 2 --micro-batches 4 --max-grad-norm 0.3
run clip_tp2_dp2_zero1 -n 4 --tp 2 --strategy zero1 --max-grad-norm 0.3
run clip_tp2_dp2_zero2 -n 4 --tp 2 --strategy zero2 --max-grad-norm 0.3
run clip_pp2_dp2_zero1 -n 4 --pp 2 --micro-batches 4 --strategy zero1 --max-grad-norm 0.3
TOL=${TANDEM_MP_TOL:-1e-4} python3 - "$out" $STEPS <<'PY' || fails=$((fails + 1))
import json, os, sys
out, steps = sys.argv[1], int(sys.argv[2])
tol = float(os.environ["TOL"])
def load(name):
    try:
        return [d["loss"] for d in map(json.loads, open(f"{out}/{name}.jsonl")) if not d.get("report")]
    except FileNotFoundError:
        return None
ref, plain = load("clip_single"), load("single")
if ref is None or plain is None or len(ref) != steps:
    print("FAIL: the single-worker references did not run"); sys.exit(1)
ok = abs(ref[-1] - plain[-1]) / plain[-1] > 1e-2
print(f"clipping active: last loss {ref[-1]:.5f} clipped, {plain[-1]:.5f} not" + ("" if ok else " FAIL"))
for name in ("clip_tp2_dp2", "clip_pp2", "clip_tp2_pp2", "clip_tp2_dp2_zero1", "clip_tp2_dp2_zero2", "clip_pp2_dp2_zero1"):
    l = load(name)
    if l is None or len(l) != steps:
        print(f"FAIL {name}: did not log {steps} steps"); ok = False; continue
    worst = max(abs(a - b) / abs(b) for a, b in zip(l, ref))
    print(f"{name}: worst relative loss difference from one clipping worker {worst:.2e}")
    if worst > tol:
        print(f"FAIL {name}: {worst:.2e} > {tol:g}"); ok = False
sys.exit(0 if ok else 1)
PY

# --pp-partition: the CNN cut where its time balances (measured on rank 0 before training) and
# by an explicit list, against one worker; the report names the cut. The cut by parameter count
# puts every convolution in stage 0 (7/3); a cut by time must not. (Not cnn_bn: batch norm over
# a micro-batch normalises with other statistics than over the batch.)
# (The runs below are the last: `common` is the CNN's from here.)
common=(--model cnn --batch 32 --lr 0.02 --schedule constant --seed 5 --max-steps 6 --no-eval --no-baseline
        --no-progress --threads 1)
run cnn_single -n 1 --strategy single
run cnn_pp2_time -n 2 --pp 2 --micro-batches 2 --pp-partition time
run cnn_pp2_list -n 2 --pp 2 --micro-batches 2 --pp-partition 3,7
python3 - "$out" <<'PY' || fails=$((fails + 1))
import json, os, sys
out = sys.argv[1]
runs = {}
for name in ("cnn_single", "cnn_pp2_time", "cnn_pp2_list"):
    path = f"{out}/{name}.jsonl"
    if os.path.exists(path):
        rows = [json.loads(l) for l in open(path)]
        runs[name] = ([d["loss"] for d in rows if not d.get("report")], [d for d in rows if d.get("report")])
ref = runs.get("cnn_single", ([], []))[0]
if len(ref) != 6:
    print("FAIL: the cnn single-worker reference did not run"); sys.exit(1)
ok = True
for name, want in (("cnn_pp2_time", None), ("cnn_pp2_list", [3, 7])):
    l, reports = runs.get(name, ([], []))
    if len(l) != 6 or not reports:
        print(f"FAIL {name}: did not log 6 steps"); ok = False; continue
    worst = max(abs(a - b) / abs(b) for a, b in zip(l, ref))
    cut = reports[0]["partition"]
    print(f"{name}: partition {cut}; worst relative loss difference from one worker {worst:.2e}")
    if worst > 1e-4 or (want and cut != want) or (not want and (sum(cut) != 10 or cut[0] >= 7)):
        print(f"FAIL {name}"); ok = False
sys.exit(0 if ok else 1)
PY
grep -qE -- '^pipeline +2 stages, layers per stage 3/7,' "$out/cnn_pp2_list.log" ||
  { echo "FAIL report: cnn_pp2_list does not name the cut 3/7"; fails=$((fails + 1)); }

expect() {  # expect NAME PATTERN -- command...: non-zero exit, quickly, with a line matching PATTERN
  local name=$1 pattern=$2; shift 3
  local start=$SECONDS
  timeout 60 "$@" >"$out/bad.out" 2>&1
  local rc=$?
  if [ $rc -eq 0 ] || [ $rc -eq 124 ] || ! grep -qE -- "$pattern" "$out/bad.out"; then
    echo "FAIL $name (exit $rc, $((SECONDS - start)) s); output:"; sed 's/^/    /' "$out/bad.out" | tail -20
    fails=$((fails + 1))
  else
    echo "ok   $name (exit $rc, $((SECONDS - start)) s): $(grep -m1 -E -- "$pattern" "$out/bad.out")"
  fi
}
bad=(--model mlp --no-baseline --no-progress --max-steps 1 --no-eval --threads 1)
expect grid-not-dividing "--tp 2 x --pp 2 = 4 ranks per replica does not divide the 6 workers" -- \
  "$tandem" train -n 6 --tp 2 --pp 2 "${bad[@]}"
expect tp-width-not-divisible "hidden width of a Linear pair \(1024\) is not divisible by the tensor-parallel size 3" -- \
  "$tandem" train -n 3 --tp 3 --batch 63 "${bad[@]}"
expect more-stages-than-layers "--pp 7: more pipeline stages than the 6 layers of --model mlp" -- \
  "$tandem" train -n 7 --pp 7 "${bad[@]}"
expect batch-not-micro-batched "not divisible into 4 micro-batches; use a --batch multiple of 8" -- \
  "$tandem" train -n 4 --pp 2 --micro-batches 4 --batch 60 "${bad[@]}"
expect batch-not-over-replicas "does not split evenly over 2 data-parallel replicas" -- \
  "$tandem" train -n 4 --tp 2 --batch 63 "${bad[@]}"
expect single-with-tp "strategy single runs one worker" -- "$tandem" train -n 2 --tp 2 --strategy single "${bad[@]}"
expect bad-schedule "unknown pipeline schedule 'zigzag'; use gpipe, 1f1b, interleaved, zb-h1 or zb-v" -- \
  "$tandem" train -n 2 --pp 2 --pipeline-schedule zigzag "${bad[@]}"
expect bad-partition-word "--pp-partition 'layers': use params, time, or the layers of each of the 2 stages" -- \
  "$tandem" train -n 2 --pp 2 --pp-partition layers "${bad[@]}"
expect bad-partition-count "it lists 3 stage\(s\), not 2" -- \
  "$tandem" train -n 2 --pp 2 --pp-partition 1,2,3 "${bad[@]}"
expect bad-partition-zero "every stage needs at least one layer" -- \
  "$tandem" train -n 2 --pp 2 --pp-partition 0,6 "${bad[@]}"
expect bad-partition-sum "the partition covers 5 layers but the model has 6" -- \
  "$tandem" train -n 2 --pp 2 --pp-partition 2,3 "${bad[@]}"

if [ $fails -ne 0 ]; then echo "model-parallel train: $fails failure(s)"; exit 1; fi
echo "model-parallel train ok"
