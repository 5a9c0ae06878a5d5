#!/usr/bin/env bash
# scripts/gpu-check.sh OUTDIR
#
# One command for a GPU machine without internet: builds Tandem's GPU pieces, checks the NCCL
# backend on the GPU and benchmarks Tandem DDP against PyTorch DDP (see docs/GPU.md).
#   (a) versions and nvidia-smi           -> OUTDIR/01-env.log
#   (b) configure + build (build-gpu/)     -> OUTDIR/02-configure.log, 03-build.log
#   (c) NCCL correctness (and a ZeRO-3 checkpoint on the GPU loaded back, LoRA under ZeRO-3,
#       ring attention and a Llama under context parallelism over the ranks, PowerSGD at full
#       rank against the exact average, hsdp against DDP, zb-h1 and zb-v pipelines against
#       1F1B with 2 ranks, selective recomputation of a Llama against none with less memory,
#       mixture-of-experts layers against the CPU, --ep and --tp over the ranks against all
#       experts on every rank):
#       world size 1 (non-blocking and blocking NCCL), and 2 processes
#       sharing the GPU through the file bootstrap (skipped if NCCL refuses)  -> 1x-check-*.log
#   (d) benchmarks: bf16 matmul rate; CNN and transformer, Tandem DDP vs torch DDP -> 2x-*.log
#   (e) a table, printed last (also OUTDIR/table.txt)
# Without a GPU it builds what it can and stops before (c), exiting 0.
#
# Exit codes: 0 all ran and passed (skips allowed) or dry run without a GPU; 1 a check or
# benchmark failed; 2 usage error; 3 configure/build failed or no usable python with torch.
# Environment: TANDEM_PYTHON (python with torch; default: python3 on PATH, then .venv),
# TANDEM_GPU_BUILD_DIR (default build-gpu), TANDEM_GPU_CHECK_BUDGET (seconds, default 470),
# TANDEM_GPU_JOBS (build parallelism, default: cores), CNN_STEPS, TF_STEPS, TF_BATCH.
set -u -o pipefail

if [ $# -ne 1 ] || [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${TANDEM_GPU_BUILD_DIR:-$ROOT/build-gpu}
BUDGET=${TANDEM_GPU_CHECK_BUDGET:-470}
export PYTHONUNBUFFERED=1
START=$(date +%s)
FAILED=0
: > "$OUT/summary.log"

elapsed() { echo $(( $(date +%s) - START )); }
say() { echo "[gpu-check +$(elapsed)s] $*" | tee -a "$OUT/summary.log"; }
# Seconds a step may take: its own limit, cut to what is left of the budget.
limit() {
  local want=$1 left=$(( BUDGET - $(elapsed) ))
  [ "$left" -lt "$want" ] && want=$left
  echo "$want"
}
# step NAME LIMIT CMD...: runs CMD with a timeout, output to OUT/NAME.log; returns CMD's status
# (124 on timeout, 125 when the budget is spent before it starts).
step() {
  local name=$1 want=$2; shift 2
  local t; t=$(limit "$want")
  if [ "$t" -lt 10 ]; then
    say "SKIPPED $name: time budget (${BUDGET}s) spent"
    return 125
  fi
  local s0=$(date +%s) rc
  timeout --kill-after=10 "$t" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  [ "$rc" -eq 124 ] && echo "gpu-check: timed out after ${t}s" >> "$OUT/$name.log"
  say "$name: exit $rc in $(( $(date +%s) - s0 ))s (log: $name.log)"
  return "$rc"
}
show_tail() { echo "---- last lines of $1.log"; tail -n "${2:-25}" "$OUT/$1.log"; echo "----"; }

# ---------------------------------------------------------------- (a) environment
pick_python() {
  local c
  for c in "${TANDEM_PYTHON:-}" "$(command -v python3 || true)" "$ROOT/.venv/bin/python"; do
    [ -n "$c" ] && [ -x "$c" ] && "$c" -c "import torch" >/dev/null 2>&1 && { echo "$c"; return 0; }
  done
  return 1
}
PY=$(pick_python) || { say "no python with torch found (tried TANDEM_PYTHON, python3, .venv/bin/python)"; exit 3; }
{
  echo "== date"; date -u
  echo "== host"; uname -a; echo "cores: $(nproc)"; free -g 2>/dev/null; df -h "$ROOT" 2>/dev/null
  echo "== nvidia-smi"; nvidia-smi 2>&1 || echo "(nvidia-smi not available)"
  echo "== python"; echo "$PY"
  "$PY" - <<'EOF'
import sys, torch
print("python", sys.version.split()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda, "cuda available", torch.cuda.is_available())
try:
    print("nccl", ".".join(map(str, torch.cuda.nccl.version())))
except Exception as e:
    print("nccl: n/a", e)
try:
    import nvidia.nccl, os
    print("nvidia-nccl wheel", list(nvidia.nccl.__path__)[0])
except Exception as e:
    print("nvidia-nccl wheel: not found", e)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name} {p.total_memory / 2**30:.1f} GiB sm_{p.major}{p.minor} {p.multi_processor_count} SMs")
EOF
  echo "== tools"; cmake --version | head -1; ninja --version; (nvcc --version 2>/dev/null || /usr/local/cuda/bin/nvcc --version 2>/dev/null) | tail -2
  ${CXX:-c++} --version | head -1
  echo "== git"; git -C "$ROOT" log --oneline -1 2>/dev/null; git -C "$ROOT" status --short 2>/dev/null | head -30
} > "$OUT/01-env.log" 2>&1
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
say "python: $PY; GPUs visible to torch: $NGPU"
grep -E "^(torch|nccl|cuda:)" "$OUT/01-env.log" | sed 's/^/  /'

# ---------------------------------------------------------------- (b) configure + build
JOBS=${TANDEM_GPU_JOBS:-$(nproc)}
NCCL_OPT=AUTO
[ "$NGPU" -gt 0 ] && NCCL_OPT=ON
TARGETS=(gpu_bench)
# Header-only dependencies (nlohmann-json, CLI11) for a machine without apt: scripts/gpu-deps.sh
# copies them from this machine's /usr/include into .gpu-deps/include, which travels along.
EXTRA_FLAGS=""
if [ -d "$ROOT/.gpu-deps/include" ]; then
  EXTRA_FLAGS="-isystem $ROOT/.gpu-deps/include"
  export CPLUS_INCLUDE_PATH="$ROOT/.gpu-deps/include${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
fi
if ! echo '#include <nlohmann/json.hpp>' | ${CXX:-c++} -std=c++17 -E -x c++ - -o /dev/null >/dev/null 2>&1; then
  say "FAILED: nlohmann/json.hpp not found (the library needs it); run scripts/gpu-deps.sh on a machine that has it and bring .gpu-deps/ along"
  exit 3
fi
if echo '#include <CLI/CLI.hpp>' | ${CXX:-c++} -std=c++17 -E -x c++ - -o /dev/null >/dev/null 2>&1; then
  TARGETS+=(tandem_cli)
else
  say "CLI11 headers not found: building gpu_bench only (not the tandem CLI)"
fi
export TORCH_CUDA_ARCH_LIST=9.0
step 02-configure 240 cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DTANDEM_BUILD_TESTS=OFF -DTANDEM_WITH_MPI=OFF -DTANDEM_WITH_NCCL="$NCCL_OPT" \
  -DTANDEM_PYTHON="$PY" -DTORCH_CUDA_ARCH_LIST=9.0 -DCMAKE_CXX_FLAGS="$EXTRA_FLAGS"
rc=$?
if [ "$rc" -ne 0 ]; then show_tail 02-configure 40; say "FAILED: configure (exit $rc)"; exit 3; fi
grep -E "^-- Tandem:" "$OUT/02-configure.log" | sed 's/^/  /'
step 03-build 420 ninja -C "$BUILD" -j "$JOBS" "${TARGETS[@]}"
rc=$?
if [ "$rc" -ne 0 ]; then show_tail 03-build 60; say "FAILED: build of ${TARGETS[*]} (exit $rc)"; exit 3; fi
BENCH="$BUILD/gpu_bench"
say "built ${TARGETS[*]} in $BUILD"

if [ "$NGPU" -eq 0 ]; then
  say "no GPU found: stopping before the GPU steps (configure and build passed; logs in $OUT)"
  exit 0
fi
if ! grep -q "NCCL backend ON" "$OUT/02-configure.log"; then
  say "FAILED: a GPU is present but the build has no NCCL backend (see 02-configure.log)"
  exit 3
fi

# ---------------------------------------------------------------- (c) correctness on the GPU
# Results: "ok", "FAILED (...)" or "skipped (...)", for the summary.
declare -A RESULT
check_result() {  # NAME RC
  local name=$1 rc=$2
  if [ "$rc" -eq 0 ]; then RESULT[$name]="ok"
  elif [ "$rc" -eq 3 ]; then RESULT[$name]="skipped (NCCL refused the setup)"
  elif [ "$rc" -eq 125 ]; then RESULT[$name]="skipped (time budget)"
  else RESULT[$name]="FAILED (exit $rc)"; FAILED=1; show_tail "$name" 30; fi
  grep -E "^check: rank" "$OUT/$name.log" 2>/dev/null | sed 's/^/  /'
}
step 10-check-ws1 120 "$BENCH" check
check_result 10-check-ws1 $?
step 11-check-ws1-blocking 90 env TANDEM_NCCL_BLOCKING=1 "$BENCH" check --skip-timeout-test
check_result 11-check-ws1-blocking $?

# Two ranks on the one GPU, bootstrapped through files (no MPI). NCCL usually refuses two
# ranks on one device ("Duplicate GPU detected"); that is reported as skipped.
two_ranks() {
  local store pids=() rcs=() r
  store=$(mktemp -d "${TMPDIR:-/tmp}/tandem-store.XXXXXX")
  for r in 0 1; do
    RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 TANDEM_STORE_DIR=$store \
      TANDEM_JOB_ID=gpucheck-$$ NCCL_DEBUG=${NCCL_DEBUG:-WARN} \
      "$BENCH" check > "$OUT/12-check-ws2-rank$r.log" 2>&1 &
    pids+=($!)
  done
  # Wait for both; once one has exited with an error, give the other 15 s, then stop it
  # (a rank whose peer is gone would otherwise wait out its 60 s timeout).
  local grace=-1 done_count=0
  rcs=("" "")
  while [ "$done_count" -lt 2 ]; do
    for r in 0 1; do
      [ -n "${rcs[$r]}" ] && continue
      if [ ! -e "/proc/${pids[$r]}" ] || grep -q '^[0-9]* ([^)]*) Z' "/proc/${pids[$r]}/stat" 2>/dev/null; then
        wait "${pids[$r]}"; rcs[$r]=$?; done_count=$((done_count + 1))
        [ "${rcs[$r]}" -ne 0 ] && [ "$grace" -lt 0 ] && grace=15
      fi
    done
    if [ "$grace" -eq 0 ]; then
      for r in 0 1; do [ -z "${rcs[$r]}" ] && kill "${pids[$r]}" 2>/dev/null; done
    fi
    [ "$grace" -gt 0 ] && grace=$((grace - 1))
    [ "$done_count" -lt 2 ] && sleep 1
  done
  rm -rf "$store"
  cat "$OUT/12-check-ws2-rank0.log" "$OUT/12-check-ws2-rank1.log"
  echo "rank exit codes: ${rcs[*]}"
  if grep -qi "duplicate GPU" "$OUT"/12-check-ws2-rank*.log; then return 3; fi
  [ "${rcs[0]}" -eq 0 ] && [ "${rcs[1]}" -eq 0 ] && return 0
  { [ "${rcs[0]}" -eq 3 ] || [ "${rcs[1]}" -eq 3 ]; } && return 3
  return 1
}
export BENCH OUT
step 12-check-ws2 100 bash -c "$(declare -f two_ranks); two_ranks"
check_result 12-check-ws2 $?

if [ -n "${TARGETS[1]:-}" ]; then
  step 13-cli-selftest 60 "$BUILD/tandem" selftest -n 1 --device cuda
  check_result 13-cli-selftest $?
fi

# ---------------------------------------------------------------- (d) benchmarks
result_line() { grep -h "^RESULT " "$OUT/$1.log" 2>/dev/null | tail -1 | sed 's/^RESULT //'; }
json_get() { "$PY" -c "import json,sys; print(json.loads(sys.argv[1]).get(sys.argv[2], ''))" "$1" "$2" 2>/dev/null; }
bench_result() {  # NAME RC
  local name=$1 rc=$2
  if [ "$rc" -eq 0 ] && [ -n "$(result_line "$name")" ]; then RESULT[$name]="ok"
  elif [ "$rc" -eq 125 ]; then RESULT[$name]="skipped (time budget)"
  else RESULT[$name]="FAILED (exit $rc)"; FAILED=1; show_tail "$name" 20; fi
}

step 20-matmul 60 "$PY" "$ROOT/bench/torch_ddp_gpu.py" --matmul --n 8192
bench_result 20-matmul $?

CNN_STEPS=${CNN_STEPS:-50}
step 21-cnn-tandem 90 "$BENCH" bench --model cnn --batch 512 --steps "$CNN_STEPS" --warmup 10
bench_result 21-cnn-tandem $?
step 22-cnn-torch 90 "$PY" "$ROOT/bench/torch_ddp_gpu.py" --model cnn --batch 512 --steps "$CNN_STEPS" --warmup 10
bench_result 22-cnn-torch $?

TF_STEPS=${TF_STEPS:-20}
TF_BATCH=${TF_BATCH:-32}
TF_ARGS=(--layers 12 --dmodel 2048 --heads 16 --seq 2048 --steps "$TF_STEPS" --warmup 5)
step 23-transformer-tandem 200 "$BENCH" bench --model transformer --batch "$TF_BATCH" "${TF_ARGS[@]}"
bench_result 23-transformer-tandem $?
# Same batch as Tandem ended up with (it halves the batch on out-of-memory).
tb=$(json_get "$(result_line 23-transformer-tandem)" batch)
step 24-transformer-torch 200 "$PY" "$ROOT/bench/torch_ddp_gpu.py" --model transformer --batch "${tb:-$TF_BATCH}" "${TF_ARGS[@]}"
bench_result 24-transformer-torch $?

# ---------------------------------------------------------------- (e) summary and table
say "results:"
for k in $(printf '%s\n' "${!RESULT[@]}" | sort); do echo "  $k: ${RESULT[$k]}" | tee -a "$OUT/summary.log"; done
"$PY" - "$OUT" > "$OUT/table.txt" 2>&1 <<'EOF'
import json, os, sys
out = sys.argv[1]
def res(name):
    try:
        lines = [l for l in open(os.path.join(out, name + ".log")) if l.startswith("RESULT ")]
        return json.loads(lines[-1][7:]) if lines else None
    except OSError:
        return None
mm = res("20-matmul")
peak = 989.0
meas = mm["tflops"] if mm else None
print("transformer FLOPs/step = 6*params*tokens + 12*layers*seq^2*d_model*batch (tokens = batch*seq;")
print("  non-causal attention; flash-attention recompute not counted); MFU against the H200 dense bf16")
print(f"  peak {peak:.0f} TFLOP/s and against the measured 8192^3 bf16 torch.matmul rate: "
      + (f"{meas:.0f} TFLOP/s" if meas else "n/a"))
print()
rows = [("cnn (b512, fp32)", res("21-cnn-tandem"), res("22-cnn-torch")),
        ("transformer (12x2048, s2048, bf16)", res("23-transformer-tandem"), res("24-transformer-torch"))]
hdr = ["model", "batch", "tandem ms/step", "torch DDP ms/step", "ratio", "TFLOP/s (tandem, torch)",
       "MFU vs 989 (tandem, torch)", "MFU vs matmul (tandem, torch)"]
table = []
def f(x, fmt):
    return format(x, fmt) if isinstance(x, (int, float)) else "n/a"
for name, t, p in rows:
    tm = t["ms_median"] if t else None
    pm = p["ms_median"] if p else None
    bs = [str(r["batch"]) if r else "n/a" for r in (t, p)]
    batch = bs[0] if bs[0] == bs[1] else f"{bs[0]}, {bs[1]}"
    ratio = f(tm / pm, ".3f") if tm and pm else "n/a"
    tf = [r["tflops"] if r and r.get("tflops") else None for r in (t, p)]
    if any(tf):
        tfl = ", ".join(f(x, ".0f") for x in tf)
        mfu = ", ".join(f"{x / peak * 100:.1f}%" if x else "n/a" for x in tf)
        mfm = ", ".join(f"{x / meas * 100:.1f}%" if x and meas else "n/a" for x in tf)
    else:
        tfl = mfu = mfm = "-"
    table.append([name, batch, f(tm, ".2f"), f(pm, ".2f"), ratio, tfl, mfu, mfm])
w = [max(len(str(r[i])) for r in table + [hdr]) for i in range(len(hdr))]
line = lambda r: "| " + " | ".join(str(c).ljust(w[i]) for i, c in enumerate(r)) + " |"
print(line(hdr))
print("|" + "|".join("-" * (x + 2) for x in w) + "|")
for r in table:
    print(line(r))
print("ms/step: median over the timed steps (CUDA events); ratio = tandem / torch (< 1: Tandem faster). Both: world size 1,")
print("NCCL, AdamW per-tensor, the same model, batch and precision.")
EOF
if [ "$FAILED" -ne 0 ]; then say "SOME STEPS FAILED (see above and the logs in $OUT)"; else say "all steps passed (skips listed above)"; fi
echo
cat "$OUT/table.txt"
exit "$FAILED"
