# Shared by tests/e2e/multinode_*.sh (source it after setting NET_ID):
#   mn_hosts HOST...   exits 77 (SKIPPED) where network namespaces are unavailable; otherwise
#                      brings up the hosts tdm$NET_ID-launcher and HOST... (tests/netns/netns.sh),
#                      makes the scratch directory $out, and removes both when the script exits.
#   mn_launch CMD...   runs CMD on the launcher host, with the rsh agent that starts MPI's
#                      daemons in the other hosts.
#   $mn_net            the hosts' subnet, for --net-if.
mn_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$mn_dir/netns/netns.sh"
mn_net="10.$((200 + NET_ID)).0.0/24"

mn_hosts() {
  netns_available || exit 77
  out=$(mktemp -d)
  trap 'netns_down "$NET_ID"; rm -rf "$out"' EXIT
  netns_up "$NET_ID" "tdm$NET_ID-launcher" "$@"
}

mn_launch() {
  OMPI_MCA_plm_rsh_agent="$mn_dir/netns/rsh-agent.sh" netns_exec "tdm$NET_ID-launcher" "$@"
}
