#!/usr/bin/env bash
# `tandem train --checkpoint-dir D --checkpoint-every N --resume`: a 2-worker DDP run of 20
# steps saves at 10 and 20; resuming from step 10 (step 20 removed) gives the same losses for
# steps 11-20 bit for bit; resuming the same checkpoint as ZeRO-2 on 2 workers matches within
# 1e-5 (ZeRO vs DDP rounding), and so does resuming on 1 worker (the same global batches);
# a checkpoint of another model or batch is refused.
# Mode "pipeline": a 2-stage pipeline run (--pp 2) saves at 10 and 20 (each stage's rank writes
# its stage); resuming from step 10 with --pp 2 gives the same losses bit for bit, and as one
# worker, 2 DDP workers and 2 replicas x 2 stages within 1e-5; the checkpoint the latter saves
# at step 20 (written by one rank per stage of 4) resumes on one worker within 1e-5 too. With
# --strategy zero1 over the 2 replicas of each stage: bitwise resume, and on one worker within
# 1e-5; the DDP pipeline's checkpoint resumes as ZeRO-1 within 1e-5. ZeRO-2 and ZeRO-3 the same
# way: bitwise resume, and on one worker within 1e-5.
# Mode "tp": a 2-way tensor-parallel run (--tp 2) saves the whole model at 10 and 20 (the
# shards gathered, rank 0 writes); it runs bit for bit as without checkpoints; resuming from
# step 10 with --tp 2 gives the same losses bit for bit, and as one worker, 2 DDP workers and
# 2 replicas x 2 shards within 1e-5; a DDP checkpoint resumes with --tp 2 within 1e-5, and the
# checkpoint of the 2 x 2 run at step 20 on one worker. --tp 2 --pp 2, --tp 2 with ZeRO-3 over 2
# replicas, and --tp 2 --pp 2 with ZeRO-1 resume themselves bit for bit and on one worker
# within 1e-5, and a DDP checkpoint resumes as the latter.
# Mode "async": --checkpoint-async changes no loss, and writes the same files as synchronous saves
# byte for byte (DDP: rank 0 writes; ZeRO-2: each rank its chunks; --tp 2: gathered); a run
# resumed from an asynchronous checkpoint continues bit for bit; the report counts the saves.
# usage: train_checkpoint.sh TANDEM [ddp|pipeline|tp|async]
set -euo pipefail
tandem=$1
mode=${2:-ddp}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
base=(--optimizer adamw --lr 0.001 --seed 5 --max-steps 20 --no-eval --no-baseline --no-progress --threads 1
      --checkpoint-every 10)
common=(--model mlp --batch 64 "${base[@]}")
run() {  # name, args...
  local name=$1
  shift
  "$tandem" train "${common[@]}" --metrics "$out/$name.jsonl" "$@" >"$out/log_$name" 2>&1 ||
    { echo "run $name failed:"; cat "$out/log_$name"; exit 1; }
}

# compare REF NAME:KIND:FIRST-LAST...: run NAME logged exactly steps FIRST..LAST, with the losses
# of run REF bit for bit (KIND bitwise) or within 1e-5 relative (KIND tol).
# writers MANIFEST KEY RANKS ...: the ranks whose shards hold pieces of each tensor (comma-separated).
writers() {
  python3 - "$@" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
tensors = {t["key"]: t for t in m["layout"]["tensors"]}
ok = m["layout"]["kind"] == "pieces"
for key, want in zip(sys.argv[2::2], sys.argv[3::2]):
    got = sorted(p["rank"] for p in tensors[key]["pieces"])
    good = got == sorted(int(r) for r in want.split(","))
    ok = ok and good
    print(f"{key}: written by rank(s) {got} {'ok' if good else 'FAILED, expected ' + want}")
sys.exit(0 if ok else 1)
PY
}

compare() {
  python3 - "$out" "$@" <<'PY'
import json, sys
out, ref, runs = sys.argv[1], sys.argv[2], sys.argv[3:]
def load(s):
    return {d["step"]: d["loss"] for d in map(json.loads, open(f"{out}/{s}.jsonl")) if not d.get("report")}
full, ok = load(ref), True
for spec in runs:
    name, kind, span = spec.split(":")
    first, last = map(int, span.split("-"))
    r = load(name)
    steps = list(range(first, last + 1))
    if sorted(r) != steps:
        print(f"{name}: steps {sorted(r)}, expected {steps}"); ok = False; continue
    worst = max(abs(r[s] - full[s]) / abs(full[s]) for s in steps)
    good = all(r[s] == full[s] for s in steps) if kind == "bitwise" else worst <= 1e-5
    print(f"{name}: steps {steps[0]}-{steps[-1]}, worst relative difference {worst:.2e} ({kind}) {'ok' if good else 'FAILED'}")
    ok = ok and good
sys.exit(0 if ok else 1)
PY
}

if [[ "$mode" == async ]]; then
  for v in "ddp:--strategy ddp" "z2:--strategy zero2" "tp:--tp 2"; do
    name=${v%%:*}
    read -r -a args <<<"${v#*:}"
    run "${name}_sync" -n 2 "${args[@]}" --checkpoint-dir "$out/${name}_sync"
    run "${name}_async" -n 2 "${args[@]}" --checkpoint-dir "$out/${name}_async" --checkpoint-async
    grep -q "checkpoints *2 saved (asynchronous)" "$out/log_${name}_async" ||
      { echo "$name: the report does not count 2 asynchronous saves:"; cat "$out/log_${name}_async"; exit 1; }
    for step in step-00000010 step-00000020; do
      files=$(cd "$out/${name}_sync/$step" && ls)
      [[ "$files" == "$(cd "$out/${name}_async/$step" && ls)" ]] || { echo "$name $step: other files"; exit 1; }
      for f in $files; do
        cmp "$out/${name}_sync/$step/$f" "$out/${name}_async/$step/$f" ||
          { echo "$name $step/$f differs between synchronous and asynchronous saves"; exit 1; }
      done
    done
    if ls -a "$out/${name}_async" | grep -q '^\.tmp-'; then echo "$name: a temporary directory was left"; exit 1; fi
    mkdir -p "$out/${name}_resume" && cp -r "$out/${name}_async/step-00000010" "$out/${name}_resume/"
    run "${name}_resume" -n 2 "${args[@]}" --checkpoint-dir "$out/${name}_resume" --checkpoint-async --resume
    compare "${name}_sync" "${name}_async:bitwise:1-20" "${name}_resume:bitwise:11-20"
  done
  echo "checkpoint async ok"
  exit 0
fi

if [[ "$mode" == tp ]]; then
  # Tensor parallelism (--tp 2): each rank writes its own block of every split weight, and rank 0
  # alone what the tp ranks replicate.
  common=(--model mlp --batch 64 --optimizer adamw --lr 0.001 --seed 5 --max-steps 24 --no-eval --no-baseline
          --no-progress --threads 1)
  run full -n 2 --tp 2 --checkpoint-every 10 --checkpoint-dir "$out/full"
  writers "$out/full/step-00000010/manifest.json" param/1.weight 0,1 param/5.weight 0
  # Checkpointing leaves the run itself unchanged.
  run plain -n 2 --tp 2
  common+=(--checkpoint-every 10)
  for d in tp one ddp tp4; do
    mkdir -p "$out/$d"
    cp -r "$out/full/step-00000010" "$out/$d/"
  done
  run tp -n 2 --tp 2 --checkpoint-dir "$out/tp" --resume
  run one -n 1 --strategy single --checkpoint-dir "$out/one" --resume
  grep -q "resuming from .*step-00000010 (step 10, saved by ddp on 2 worker" "$out/log_one"
  run ddp -n 2 --strategy ddp --checkpoint-dir "$out/ddp" --resume
  run tp4 -n 4 --tp 2 --checkpoint-dir "$out/tp4" --resume
  # The other way: a DDP checkpoint (full's DDP twin, saved at 10) cut for --tp 2, and the
  # checkpoint the 2 replicas x 2 shards saved at 20 resumed on one worker.
  run dfull -n 2 --strategy ddp --checkpoint-dir "$out/dfull"
  mkdir -p "$out/dtp" && cp -r "$out/dfull/step-00000010" "$out/dtp/"
  run dtp -n 2 --tp 2 --checkpoint-dir "$out/dtp" --resume
  mkdir -p "$out/one20" && cp -r "$out/tp4/step-00000020" "$out/one20/"
  run one20 -n 1 --strategy single --checkpoint-dir "$out/one20" --resume
  grep -q "saved by ddp on 4 worker" "$out/log_one20"
  # With --pp, with ZeRO-3 over the replicas, and with --pp and ZeRO-1 (2 x 2 workers; 2 x 2 x 2 stages, shards and
  # replicas would need 8): the same gather, by stage with --pp (the first tp rank of each
  # stage's first replica writes it). Each resumes itself bit for bit and on one worker.
  for v in "tpp:--tp 2 --pp 2 --micro-batches 2" "tz3:--tp 2 --strategy zero3" "tppz:--tp 2 --pp 2 --micro-batches 2 --strategy zero1"; do
    name=${v%%:*}
    read -r -a args <<<"${v#*:}"
    run "$name" -n 4 "${args[@]}" --checkpoint-dir "$out/$name"
    for d in "${name}_r" "${name}_one"; do
      mkdir -p "$out/$d"
      cp -r "$out/$name/step-00000010" "$out/$d/"
    done
    run "${name}_r" -n 4 "${args[@]}" --checkpoint-dir "$out/${name}_r" --resume
    run "${name}_one" -n 1 --strategy single --checkpoint-dir "$out/${name}_one" --resume
    compare "$name" "${name}_r:bitwise:11-24" "${name}_one:tol:11-24"
  done
  writers "$out/tppz/step-00000010/manifest.json" param/1.weight 0,1 param/5.weight 2
  # A DDP checkpoint cut for tensor, pipeline and ZeRO-1 parallelism at once.
  mkdir -p "$out/d3" && cp -r "$out/dfull/step-00000010" "$out/d3/"
  run d3 -n 4 --tp 2 --pp 2 --micro-batches 2 --strategy zero1 --checkpoint-dir "$out/d3" --resume
  compare dfull d3:tol:11-24
  compare full plain:bitwise:1-24 tp:bitwise:11-24 one:tol:11-24 ddp:tol:11-24 tp4:tol:11-24 one20:tol:21-24
  compare dfull dtp:tol:11-24
  echo "checkpoint tp ok"
  exit 0
fi

if [[ "$mode" == pipeline ]]; then
  common=(--model mlp --batch 64 --micro-batches 2 --optimizer adamw --lr 0.001 --seed 5 --no-eval --no-baseline
          --no-progress --threads 1 --checkpoint-every 10)
  run full -n 2 --pp 2 --max-steps 24 --checkpoint-dir "$out/full"
  writers "$out/full/step-00000010/manifest.json" param/1.weight 0 param/5.weight 1
  for d in pp one ddp pp4; do
    mkdir -p "$out/$d"
    cp -r "$out/full/step-00000010" "$out/$d/"
  done
  run pp -n 2 --pp 2 --max-steps 24 --checkpoint-dir "$out/pp" --resume
  run one -n 1 --strategy single --max-steps 24 --checkpoint-dir "$out/one" --resume
  run ddp -n 2 --strategy ddp --max-steps 24 --checkpoint-dir "$out/ddp" --resume
  grep -q "resuming from .*step-00000010 (step 10, saved by ddp x pp2 on 2 worker" "$out/log_one"
  run pp4 -n 4 --pp 2 --max-steps 24 --checkpoint-dir "$out/pp4" --resume
  mkdir -p "$out/one20" && cp -r "$out/pp4/step-00000020" "$out/one20/"
  run one20 -n 1 --strategy single --max-steps 24 --checkpoint-dir "$out/one20" --resume
  grep -q "saved by ddp x pp2 on 4 worker" "$out/log_one20"
  # With ZeRO-1 over the replicas of each stage: the stage's chunks are gathered and its first
  # replica writes it. 2 replicas x 2 stages, 24 steps; resumed from step 10 the same way (bit
  # for bit) and on one worker; the DDP pipeline's checkpoint resumed under ZeRO-1 too.
  run zfull -n 4 --pp 2 --strategy zero1 --max-steps 24 --checkpoint-dir "$out/zfull"
  for d in zpp zone; do
    mkdir -p "$out/$d"
    cp -r "$out/zfull/step-00000010" "$out/$d/"
  done
  run zpp -n 4 --pp 2 --strategy zero1 --max-steps 24 --checkpoint-dir "$out/zpp" --resume
  run zone -n 1 --strategy single --max-steps 24 --checkpoint-dir "$out/zone" --resume
  grep -q "saved by zero1 x pp2 on 4 worker" "$out/log_zone"
  mkdir -p "$out/zfromddp" && cp -r "$out/full/step-00000010" "$out/zfromddp/"
  run zfromddp -n 4 --pp 2 --strategy zero1 --max-steps 24 --checkpoint-dir "$out/zfromddp" --resume
  compare full pp:bitwise:11-24 one:tol:11-24 ddp:tol:11-24 pp4:tol:11-24 one20:tol:21-24 zfromddp:tol:11-24
  compare zfull zpp:bitwise:11-24 zone:tol:11-24
  # ZeRO-2 and ZeRO-3 over the replicas of each stage: resumed bit for bit, and on one worker.
  for z in zero2 zero3; do
    run ${z}full -n 4 --pp 2 --strategy $z --max-steps 24 --checkpoint-dir "$out/${z}full"
    for d in ${z}pp ${z}one; do
      mkdir -p "$out/$d"
      cp -r "$out/${z}full/step-00000010" "$out/$d/"
    done
    run ${z}pp -n 4 --pp 2 --strategy $z --max-steps 24 --checkpoint-dir "$out/${z}pp" --resume
    run ${z}one -n 1 --strategy single --max-steps 24 --checkpoint-dir "$out/${z}one" --resume
    grep -q "saved by $z x pp2 on 4 worker" "$out/log_${z}one"
    compare ${z}full ${z}pp:bitwise:11-24 ${z}one:tol:11-24
  done
  echo "checkpoint pipeline ok"
  exit 0
fi

run full -n 2 --strategy ddp --checkpoint-dir "$out/full"
ls "$out/full"
test -f "$out/full/step-00000010/manifest.json" && test -f "$out/full/step-00000020/manifest.json"
for d in ddp zero2 one; do
  mkdir -p "$out/$d"
  cp -r "$out/full/step-00000010" "$out/$d/"
done
run ddp -n 2 --strategy ddp --checkpoint-dir "$out/ddp" --resume
run zero2 -n 2 --strategy zero2 --checkpoint-dir "$out/zero2" --resume
run one -n 1 --strategy single --checkpoint-dir "$out/one" --resume
grep -q "resuming from .*step-00000010 (step 10, saved by ddp on 2 worker" "$out/log_ddp"
test -f "$out/ddp/step-00000020/manifest.json"

# Refused: another model, another global batch (exit non-zero, a clear message, nothing written).
if "$tandem" train "${base[@]}" --batch 64 -n 1 --strategy single --model cnn --checkpoint-dir "$out/one" --resume \
    >"$out/log_bad_model" 2>&1; then
  echo "FAIL: resuming an mlp checkpoint as --model cnn succeeded"; exit 1
fi
grep -q "is of model 'mlp', not 'cnn'" "$out/log_bad_model" || { cat "$out/log_bad_model"; exit 1; }
if "$tandem" train "${base[@]}" --model mlp -n 1 --strategy single --batch 32 --checkpoint-dir "$out/one" --resume \
    >"$out/log_bad_batch" 2>&1; then
  echo "FAIL: resuming with another --batch succeeded"; exit 1
fi
grep -q "resume with the same global batch" "$out/log_bad_batch" || { cat "$out/log_bad_batch"; exit 1; }

python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def load(s):
    return {d["step"]: d["loss"] for d in map(json.loads, open(f"{out}/{s}.jsonl")) if not d.get("report")}
full, ddp, zero2, one = load("full"), load("ddp"), load("zero2"), load("one")
ok = sorted(full) == list(range(1, 21)) and all(sorted(r) == list(range(11, 21)) for r in (ddp, zero2, one))
print("steps:", sorted(ddp), sorted(zero2), sorted(one))
same = all(ddp[s] == full[s] for s in range(11, 21))
print("ddp resume bitwise identical for steps 11-20:", same)
worst = max(abs(zero2[s] - full[s]) / abs(full[s]) for s in range(11, 21))
print(f"zero2 resume: worst relative difference {worst:.2e}")
# One worker sees the same global batches (the sampler keeps the global order for any world size).
worst1 = max(abs(one[s] - full[s]) / abs(full[s]) for s in range(11, 21))
print(f"1-worker resume: worst relative difference {worst1:.2e}")
ok = ok and same and worst <= 1e-5 and worst1 <= 1e-5
print("checkpoint train " + ("ok" if ok else "FAILED"))
sys.exit(0 if ok else 1)
PY
