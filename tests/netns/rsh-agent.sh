#!/usr/bin/env bash
# ssh stand-in for OpenMPI's rsh launcher in network-namespace hosts (tests/netns/netns.sh):
#   OMPI_MCA_plm_rsh_agent=/path/to/rsh-agent.sh mpirun --hostfile H ...
# OpenMPI runs "AGENT [ssh options] HOST COMMAND WORDS..."; like ssh, the command words are
# joined with spaces and run by a shell, here inside HOST's namespace with HOST as host name.
set -euo pipefail
# ssh-style options OpenMPI may pass (-x, -T, -o X, -p N, -l USER) carry no meaning here.
while [[ $# -gt 0 && "$1" == -* ]]; do
  case "$1" in
    -o | -p | -l | -i | -F) shift 2 ;;
    *) shift ;;
  esac
done
[[ $# -ge 2 ]] || { echo "usage: rsh-agent.sh HOST COMMAND..." >&2; exit 255; }
host=$1
shift
ip netns list | grep -q "^$host\b" || { echo "rsh-agent.sh: no network namespace '$host' (netns_up made none)" >&2; exit 255; }
exec ip netns exec "$host" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
