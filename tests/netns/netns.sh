# Hosts made of Linux network namespaces on one machine, for multi-node tests (source this file).
#
# Interface (other tests depend on it; keep it stable):
#   netns_available             exit 0 if we are root and namespaces, veth pairs and bridges work
#                               here; otherwise print why and return non-zero (tests then exit 77,
#                               which ctest reports as SKIPPED through SKIP_RETURN_CODE 77).
#   netns_up NET_ID HOST...     one network namespace per HOST (its name is the host name, e.g.
#                               tdm3-h0 or job-worker-0), HOST number i (from 0) at
#                               10.(200+NET_ID).0.(i+1)/24 on interface eth0, all linked by a bridge
#                               private to NET_ID (in its own namespace tdmsw<NET_ID>, away from the
#                               machine's firewall); loopback up; /etc/netns/HOST/{hosts,hostname}
#                               so that every host name resolves to its address inside every host.
#                               NET_ID (0-50) keeps concurrent tests apart (their host names must
#                               differ too: a namespace is named after its host). Leftovers of the
#                               same NET_ID, or of the same host names, from an earlier, crashed run
#                               are removed first.
#   netns_down NET_ID           kills the processes left in the hosts and removes the namespaces,
#                               the bridge and the /etc/netns entries (safe to call twice; meant
#                               for the caller's EXIT trap: trap 'netns_down 3' EXIT).
#   netns_ip NET_ID HOST        prints HOST's address.
#   netns_exec HOST CMD...      runs CMD inside HOST's namespace with its own UTS namespace whose
#                               host name is HOST (OpenMPI tells nodes apart by host name).
#   netns_link NET_ID HOST up|down
#                               takes HOST's link up or down (a cable pulled; the host's processes
#                               keep running).
#   tests/netns/rsh-agent.sh HOST CMD...
#                               ssh stand-in for OpenMPI (OMPI_MCA_plm_rsh_agent): runs the shell
#                               command CMD in HOST through netns_exec; ssh options are ignored.
#
# State: /run/tandem-netns/<NET_ID> lists the hosts of a NET_ID (one per line, in order).

NETNS_STATE=${NETNS_STATE:-/run/tandem-netns}

netns_available() {
  if [[ $(id -u) -ne 0 ]]; then
    echo "netns: not root; network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    return 1
  fi
  local tool
  for tool in ip unshare; do
    command -v "$tool" >/dev/null || { echo "netns: '$tool' not found; apt-get install iproute2 util-linux"; return 1; }
  done
  local probe="tdmprobe$$" err
  if ! err=$(ip netns add "$probe" 2>&1); then
    echo "netns: 'ip netns add' fails here: $err"
    return 1
  fi
  if ! err=$( { ip link add "${probe}a" type veth peer name "${probe}b" && ip link del "${probe}a" &&
                ip -n "$probe" link add "${probe}br" type bridge && ip netns exec "$probe" unshare --uts true; } 2>&1); then
    ip netns del "$probe" 2>/dev/null
    echo "netns: veth pairs, bridges or UTS namespaces do not work here: $err"
    return 1
  fi
  ip netns del "$probe"
  return 0
}

_netns_check_id() {
  [[ "$1" =~ ^[0-9]+$ ]] && (($1 <= 50)) || { echo "netns: NET_ID must be 0-50, got '$1'" >&2; return 1; }
}

netns_down() {
  _netns_check_id "$1" || return 1
  local id=$1 host pid
  if [[ -f "$NETNS_STATE/$id" ]]; then
    while read -r host; do
      [[ -n "$host" ]] || continue
      for pid in $(ip netns pids "$host" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
      ip netns del "$host" 2>/dev/null || true
      rm -rf "/etc/netns/$host"
    done <"$NETNS_STATE/$id"
    rm -f "$NETNS_STATE/$id"
  fi
  ip netns del "tdmsw$id" 2>/dev/null || true
  return 0
}

netns_up() {
  _netns_check_id "$1" || return 1
  local id=$1
  shift
  (($# >= 1 && $# <= 250)) || { echo "netns_up: give 1-250 host names" >&2; return 1; }
  local host pid
  for host in "$@"; do
    [[ "$host" =~ ^[a-zA-Z0-9][a-zA-Z0-9-]{0,62}$ ]] ||
      { echo "netns_up: '$host' is not a usable host name (letters, digits, '-')" >&2; return 1; }
  done
  netns_down "$id"
  # Names of the same hosts left by a crashed run under another NET_ID must go too.
  for host in "$@"; do
    for pid in $(ip netns pids "$host" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$host" 2>/dev/null || true
  done
  mkdir -p "$NETNS_STATE"
  printf '%s\n' "$@" >"$NETNS_STATE/$id"
  local sw="tdmsw$id" net="10.$((200 + id)).0" i=0 hosts_file
  ip netns add "$sw" && ip -n "$sw" link add br0 type bridge && ip -n "$sw" link set br0 up &&
    ip -n "$sw" link set lo up || { netns_down "$id"; return 1; }
  hosts_file=$(printf '127.0.0.1 localhost\n'; for host in "$@"; do i=$((i + 1)); printf '%s.%d %s\n' "$net" "$i" "$host"; done)
  i=0
  for host in "$@"; do
    i=$((i + 1))
    mkdir -p "/etc/netns/$host"
    printf '%s\n' "$hosts_file" >"/etc/netns/$host/hosts"
    printf '%s\n' "$host" >"/etc/netns/$host/hostname"
    ip netns add "$host" &&
      ip -n "$host" link set lo up &&
      ip -n "$host" link add eth0 type veth peer name "p$i" netns "$sw" &&
      ip -n "$host" addr add "$net.$i/24" dev eth0 &&
      ip -n "$host" link set eth0 up &&
      ip -n "$sw" link set "p$i" master br0 &&
      ip -n "$sw" link set "p$i" up || { echo "netns_up: could not set up host '$host'" >&2; netns_down "$id"; return 1; }
  done
  return 0
}

netns_ip() {
  _netns_check_id "$1" || return 1
  local n
  n=$(grep -nx -- "$2" "$NETNS_STATE/$1" 2>/dev/null | head -n1 | cut -d: -f1 || true)
  [[ -n "$n" ]] || { echo "netns_ip: no host '$2' in net $1" >&2; return 1; }
  echo "10.$((200 + $1)).0.$n"
}

netns_exec() {
  local host=$1
  shift
  ip netns exec "$host" unshare --uts sh -c 'hostname "$0" && exec "$@"' "$host" "$@"
}

netns_link() {
  _netns_check_id "$1" || return 1
  local n
  n=$(grep -nx -- "$2" "$NETNS_STATE/$1" 2>/dev/null | head -n1 | cut -d: -f1 || true)
  [[ -n "$n" && ("$3" == up || "$3" == down) ]] || { echo "usage: netns_link NET_ID HOST up|down" >&2; return 1; }
  ip -n "tdmsw$1" link set "p$n" "$3"
}
