#!/usr/bin/env bash
# `tandem pretrain` and `tandem finetune` across 2 network-namespace hosts (tests/netns): the
# same text workflow as on one host, through --hostfile and --net-if. Pre-trains 20 steps on
# 2 hosts x 1 rank, fine-tunes 20 steps from that checkpoint on 2 hosts, and the same two runs
# on this one host: the validation loss of pre-training and the fine-tuned test accuracy must
# agree (same seed, global batch and order: 1e-4 relative on the loss, equal accuracy), and
# rank 0 must report both hosts with their own addresses.
# usage: multinode_text.sh TANDEM NET_ID [DATA_DIR]   (exit 77: no netns here; no corpus fails)
set -euo pipefail
tandem=$1
NET_ID=$2
data=${3:-/usr/share/games/fortunes}
[ -d "$data" ] || { echo "FAIL: no fortune corpus at $data (apt-get install fortunes; scripts/setup.sh does)"; exit 1; }
source "$(dirname "$0")/multinode_lib.sh"
hosts=("tdm$NET_ID-h0" "tdm$NET_ID-h1")
mn_hosts "${hosts[@]}"
for h in "${hosts[@]}"; do echo "$h slots=1"; done >"$out/hostfile"
common=(--data "$data" --max-per-label 200 --batch 16 --threads 1 --seed 3 --no-progress --timeout 60)
shape=(--vocab 300 --tokenizer-sentences 800 --d-model 32 --heads 2 --layers 1 --seq 32)
multi=(--hostfile "$out/hostfile" --net-if "$mn_net")

run() {  # run NAME [mn_launch] CMD...: output in $out/NAME.log
  local name=$1; shift
  "$@" >"$out/$name.log" 2>&1 || { echo "FAIL: $name exited non-zero"; tail -30 "$out/$name.log"; exit 1; }
}
field() { grep -m1 "^$2" "$out/$1.log" | sed -E "s/^$2 +//"; }

run pre_one "$tandem" pretrain -n 2 --strategy ddp --steps 20 --lr 3e-3 --out "$out/ck_one" "${shape[@]}" "${common[@]}"
run pre_multi mn_launch "$tandem" pretrain -n 2 --strategy ddp --steps 20 --lr 3e-3 --out "$out/ck_multi" \
  "${shape[@]}" "${common[@]}" "${multi[@]}"
run ft_one "$tandem" finetune -n 2 --strategy ddp --checkpoint "$out/ck_one" --steps 20 --lr 2e-3 "${common[@]}"
run ft_multi mn_launch "$tandem" finetune -n 2 --strategy ddp --checkpoint "$out/ck_multi" --steps 20 --lr 2e-3 \
  "${common[@]}" "${multi[@]}"

fails=0
for name in pre_multi ft_multi; do
  layout=$(field "$name" hosts || true)
  echo "$name: hosts $layout"
  for i in 0 1; do
    ip=$(netns_ip "$NET_ID" "${hosts[$i]}")
    [[ "$layout" == *"${hosts[$i]} ($ip) rank"* ]] || { echo "FAIL: $name's layout does not name ${hosts[$i]} ($ip)"; fails=$((fails + 1)); }
  done
done
v1=$(field pre_one "validation loss" | awk '{print $1}'); v2=$(field pre_multi "validation loss" | awk '{print $1}')
a1=$(field ft_one "test accuracy" | awk '{print $1}'); a2=$(field ft_multi "test accuracy" | awk '{print $1}')
echo "pre-training validation loss: one host $v1, two hosts $v2; fine-tuned test accuracy: one host $a1, two hosts $a2"
python3 -c "import sys; a, b = float('$v1'), float('$v2'); sys.exit(0 if abs(a - b) <= 1e-4 * abs(a) else 1)" ||
  { echo "FAIL: validation loss differs between one and two hosts"; fails=$((fails + 1)); }
[ -n "$a1" ] && [ "$a1" = "$a2" ] || { echo "FAIL: test accuracy differs between one and two hosts"; fails=$((fails + 1)); }
[ $fails -eq 0 ] && echo "text workflow across hosts: PASSED"
exit $((fails > 0))
