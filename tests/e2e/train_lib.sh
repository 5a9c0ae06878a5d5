# Sourced by the `tandem train` comparison scripts: run NAME ARGS... trains with "$tandem" train
# "${common[@]}" ARGS, writing $out/NAME.jsonl (metrics) and $out/log_NAME, printing its seconds;
# a failed run prints its log and exits.
run() {
  local name=$1
  shift
  local t0=$SECONDS
  "$tandem" train "${common[@]}" "$@" --metrics "$out/$name.jsonl" >"$out/log_$name" 2>&1 ||
    { cat "$out/log_$name"; exit 1; }
  echo "$name: $((SECONDS - t0)) s"
}
