// Reachability of the other ranks outside MPI: each rank listens on a TCP port (the kernel
// completes the handshake; nothing is read), and after a communication failure a rank tries to
// connect to every peer's addresses. "No answer" means the peer's host cannot be reached (a link
// down, a host gone, a firewall); "refused" means its host answers but the rank's process is gone.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace tandem::detail {

// A listening TCP socket on every address of this host, on a port the kernel picks.
class ProbeListener {
 public:
  ProbeListener();
  ~ProbeListener();
  ProbeListener(const ProbeListener&) = delete;
  ProbeListener& operator=(const ProbeListener&) = delete;
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// IPv4 addresses of this host's interfaces that are up, loopback excluded. `selection`: empty
// (all), or a comma-separated list of interface names (eth0) and subnets (10.1.0.0/16), the
// forms OpenMPI's btl_tcp_if_include takes.
std::vector<std::string> local_addresses(const std::string& selection);

enum class PeerState { kAnswers, kProcessGone, kUnreachable };

struct PeerAddress {
  std::vector<std::string> addresses;  // IPv4, dotted
  int port = 0;
};

// Connects to every peer at once (all its addresses; the best outcome counts) and waits at most
// `wait` for the answers.
std::vector<PeerState> probe_peers(const std::vector<PeerAddress>& peers, std::chrono::milliseconds wait);

}  // namespace tandem::detail
