#!/usr/bin/env bash
# Per-rank peak memory and step time of tandem::models::transformer (8 blocks) under Tandem's DDP,
# ZeRO-3 (a unit per block) and ZeRO-3 + activation checkpointing (every block), against PyTorch
# DDP, FSDP FULL_SHARD with a per-block wrap policy, and the same with checkpoint_wrapper on every
# block: same shapes, batch, sequence, AdamW (lr 1e-3), random token ids, one thread per rank,
# gloo for PyTorch. Each repetition runs every configuration once per worker count, in an order
# rotated from one repetition to the next; the table gives medians over the repetitions.
#
# Step time: the slowest rank's median step, from a run without the memory meter. Memory, from a
# second run right after it, measured alike on both sides, per rank (bench/heap_peak.c, preloaded into both): the peak
# during the timed steps of the bytes held through malloc plus the rank's share of the resident
# pages of its shared mappings (MPI's segments and Tandem's symmetric blocks for DDP's buckets and
# ZeRO's scratch and gathered units, which malloc does not see), sampled together every
# millisecond, above the heap held just before the model was built: the model and its state,
# gradients, activations, gathered units and communication buffers. Beside it, Tandem's own
# accounting (model state held + MemoryMeter's peak above a step's start) against tandem plan's
# prediction for the layout.
#
# Usage: bench/fsdp_compare.sh [--reps 3] [--workers "2 4"] [--build build] [--jsonl FILE]
#                              [-- options for both sides: --d-model 256 --seq 128 --batch 8 ...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
reps=3 workers="2 4" build="$root/build" jsonl=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --reps) reps=$2; shift 2 ;;
    --workers) workers=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --jsonl) jsonl=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "fsdp_compare.sh: unknown option '$1' (see the usage at the top of the script)" >&2; exit 2 ;;
  esac
done
shape=("$@")
python="$root/.venv/bin/python"
bench="$build/bench_fsdp"
[[ -x $bench ]] || { echo "fsdp_compare.sh: $bench is missing; cmake --build $build --target bench_fsdp" >&2; exit 2; }
[[ -x $python ]] || { echo "fsdp_compare.sh: $python is missing; scripts/setup.sh makes .venv" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cc -O2 -shared -fPIC -o "$work/heap_peak.so" "$root/bench/heap_peak.c" -lpthread
out=${jsonl:-$work/runs.jsonl}
: >"$out"
mpirun=("$root/scripts/mpirun-local.sh")
meter=(-x LD_PRELOAD="$work/heap_peak.so")

configs=(tandem:ddp torch:ddp tandem:zero3 torch:fsdp tandem:zero3_ac torch:fsdp_ac)
port=29600
for ((r = 0; r < reps; r++)); do
  for n in $workers; do
    for ((k = 0; k < ${#configs[@]}; k++)); do
      c=${configs[$(((k + r) % ${#configs[@]}))]}
      impl=${c%%:*} mode=${c#*:}
      port=$((port + 1))
      if [[ $impl == tandem ]]; then
        cmd=(-n "$n" "$bench" --mode "$mode" "${shape[@]}")
      else
        cmd=(-x MASTER_PORT=$port -n "$n" "$python" "$root/bench/torch_fsdp_cpu.py" --mode "$mode" "${shape[@]}")
      fi
      # Timed without the meter (its sampler costs each rank a share of a core, more where more
      # shared memory is mapped), then measured with it; one line with both.
      timed=$("${mpirun[@]}" "${cmd[@]}" 2>"$work/err" | grep '^{' | tail -1) || true
      metered=$("${mpirun[@]}" "${meter[@]}" "${cmd[@]}" 2>>"$work/err" | grep '^{' | tail -1) || true
      if [[ -z $timed || -z $metered ]]; then
        echo "fsdp_compare.sh: no result from: ${mpirun[*]} ${cmd[*]}" >&2
        tail -5 "$work/err" >&2
        continue
      fi
      line=$(printf '%s\n%s\n' "$timed" "$metered" | "$python" -c '
import json, sys
timed, metered = (json.loads(l) for l in sys.stdin)
metered["metered_ms"], metered["median_ms"] = metered["median_ms"], timed["median_ms"]
print(json.dumps(metered))')
      echo "$line" >>"$out"
      echo "rep $r, $n workers, $impl $mode: $(echo "$line" | "$python" -c 'import json,sys; j = json.load(sys.stdin); print(round(j["median_ms"], 1), "ms; metered", round(j["metered_ms"], 1))')" >&2
    done
  done
done

"$python" - "$out" "$0 --reps $reps --workers '$workers' ${shape[*]:+-- ${shape[*]}}" <<'EOF'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
MiB = 1024.0 ** 2
def pick(impl, mode, n):
    return [r for r in runs if r["impl"] == impl and r["mode"] == mode and r["world"] == n]
def med(rs, f):
    v = [f(r) for r in rs]
    return statistics.median(v) if v else None
def fmt(v, spec=".1f"):
    return "n/a" if v is None else format(v, spec)
pairs = [("DDP", "ddp", "ddp", "torch DDP"), ("ZeRO-3", "zero3", "fsdp", "FSDP FULL_SHARD"),
         ("ZeRO-3 + AC", "zero3_ac", "fsdp_ac", "FSDP FULL_SHARD + checkpoint_wrapper")]
first = runs[0] if runs else {}
print(f"transformer: {first.get('parameters', 0):,.0f} parameters, global batch {first.get('batch')}, "
      f"{first.get('steps')} timed steps per run; medians over repetitions\n")
print("| workers | Tandem | peer | Tandem ms | peer ms | ratio | Tandem MiB (heap alone) | peer MiB "
      "| Tandem state + act. MiB | plan predicts MiB | measured / plan |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for n in sorted({r["world"] for r in runs}):
    for name, tm, pm, peer in pairs:
        t, p = pick("tandem", tm, n), pick("torch", pm, n)
        tms, pms = med(t, lambda r: r["median_ms"]), med(p, lambda r: r["median_ms"])
        def total(r):  # the rank with the most: heap + shared share, sampled together
            return max(r["peak_bytes"]) / MiB
        theap, pheap = med(t, total), med(p, total)
        tshm = med(t, lambda r: max(r["heap_peak_bytes"]) / MiB)
        own = med(t, lambda r: max(s + a for s, a in zip(r["model_state_bytes"], r["activation_peak_bytes"])) / MiB)
        plan = med(t, lambda r: r["plan_bytes"][4] / MiB)  # the planned peak
        print(f"| {n} | {name} | {peer} | {fmt(tms)} | {fmt(pms)} | {fmt(tms / pms if tms and pms else None, '.2f')} "
              f"| {fmt(theap)} ({fmt(tshm)}) | {fmt(pheap)} | {fmt(own)} | {fmt(plan)} | {fmt(own / plan if own and plan else None, '.2f')} |")
print(f"\ncommand: {sys.argv[2]}")
EOF
