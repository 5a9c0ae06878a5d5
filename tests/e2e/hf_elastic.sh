#!/usr/bin/env bash
# Elastic `tandem finetune --init-from HF_DIR -n 1:2` (the tiny random Llama of
# tests/hf/hf_fixture.py) on 2 network-namespace hosts: after the first checkpoint host 1's link
# goes down for good; the launcher must drop it, relaunch 1 worker on host 0 from the newest
# checkpoint and finish. Its per-step losses after the cut must equal (1e-6) those of a manual
# `--resume` on 1 worker from a copy of that checkpoint, and its metrics must record the one
# membership change, 2 -> 1 workers.
# usage: hf_elastic.sh TANDEM SOURCE_DIR NET_ID   (exit 77: no netns; no .venv-hf or corpus fails)
set -euo pipefail
tandem=$1
src=$2
NET_ID=$3
. "$src/tests/e2e/hf_lib.sh"            # $tmp/fx, $py, fortunes_jsonl
source "$src/tests/e2e/elastic_lib.sh"  # $out, $h0, $h1, hostfile, el_cut_after, el_wait_ok, el_fail
trap 'netns_down "$NET_ID"; rm -rf "$out" "$tmp"' EXIT
fortunes_jsonl "$tmp/lm.jsonl" 300
steps=40
lm=(--init-from "$tmp/fx/lm" --data "$tmp/lm.jsonl" --seq 32 --batch 8 --steps "$steps" --lr 2e-3 --warmup-steps 2
    --no-eval --no-progress --threads 1 --checkpoint-every 10)

mn_launch "$tandem" finetune -n 1:2 --hostfile "$out/hostfile" --net-if "$mn_net" "${lm[@]}" \
  --checkpoint-dir "$out/ck" --timeout 6 --metrics "$out/elastic.jsonl" >"$out/stdout" 2>"$out/stderr" &
job=$!
el_cut_after 10 120
el_wait_ok
resumed=$(grep -oE "2 -> 1 workers \(failure\); lost $h1; resuming from step [0-9]+" "$out/stdout" | head -n1 |
  grep -oE "[0-9]+$") || el_fail "no membership change 2 -> 1 naming $h1"

mkdir -p "$out/manual"
cp -r "$out/ck/step-$(printf '%08d' "$resumed")" "$out/manual/"
"$tandem" finetune -n 1 "${lm[@]}" --checkpoint-dir "$out/manual" --resume --metrics "$out/manual.jsonl" \
  >"$out/stdout-manual" 2>&1 || el_fail "the manual --resume failed: $(tail -n 5 "$out/stdout-manual")"
el_compare_losses "$resumed" 1 2:1
echo "elastic finetune --init-from ok"
