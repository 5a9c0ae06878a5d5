#include "runtime/peer_probe.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <stdexcept>

namespace tandem::detail {
namespace {

// "10.1.0.0/16" -> network and mask (host order); false if `s` is not a subnet.
bool parse_subnet(const std::string& s, uint32_t* net, uint32_t* mask) {
  auto slash = s.find('/');
  if (slash == std::string::npos) return false;
  in_addr a{};
  if (inet_pton(AF_INET, s.substr(0, slash).c_str(), &a) != 1) return false;
  char* end = nullptr;
  long bits = std::strtol(s.c_str() + slash + 1, &end, 10);
  if (*end != '\0' || bits < 0 || bits > 32) return false;
  *mask = bits == 0 ? 0 : ~uint32_t{0} << (32 - bits);
  *net = ntohl(a.s_addr) & *mask;
  return true;
}

bool selected(const std::string& selection, const char* ifname, uint32_t addr) {
  if (selection.empty()) return true;
  std::stringstream ss(selection);
  std::string item;
  while (std::getline(ss, item, ',')) {
    uint32_t net = 0, mask = 0;
    if (parse_subnet(item, &net, &mask) ? (addr & mask) == net : item == ifname) return true;
  }
  return false;
}

}  // namespace

ProbeListener::ProbeListener() {
  fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd_ < 0) throw std::runtime_error(std::string("cannot open the reachability socket: ") + std::strerror(errno));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof(sa);
  if (bind(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 || listen(fd_, SOMAXCONN) != 0 ||
      getsockname(fd_, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
    std::string err = std::strerror(errno);
    close(fd_);
    throw std::runtime_error("cannot listen on a TCP port for the reachability check: " + err);
  }
  port_ = ntohs(sa.sin_port);
}

ProbeListener::~ProbeListener() {
  if (fd_ >= 0) close(fd_);
}

std::vector<std::string> local_addresses(const std::string& selection) {
  std::vector<std::string> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (ifaddrs* i = list; i; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || !(i->ifa_flags & IFF_UP) ||
        (i->ifa_flags & IFF_LOOPBACK)) {
      continue;
    }
    auto* sa = reinterpret_cast<sockaddr_in*>(i->ifa_addr);
    if (!selected(selection, i->ifa_name, ntohl(sa->sin_addr.s_addr))) continue;
    char buf[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &sa->sin_addr, buf, sizeof(buf));
    if (std::find(out.begin(), out.end(), buf) == out.end()) out.emplace_back(buf);
  }
  freeifaddrs(list);
  return out;
}

std::vector<PeerState> probe_peers(const std::vector<PeerAddress>& peers, std::chrono::milliseconds wait) {
  std::vector<PeerState> state(peers.size(), PeerState::kUnreachable);
  std::vector<bool> refused(peers.size(), false);
  std::vector<pollfd> fds;
  std::vector<size_t> owner;
  for (size_t p = 0; p < peers.size(); ++p) {
    for (const auto& a : peers[p].addresses) {
      sockaddr_in sa{};
      sa.sin_family = AF_INET;
      sa.sin_port = htons(static_cast<uint16_t>(peers[p].port));
      if (inet_pton(AF_INET, a.c_str(), &sa.sin_addr) != 1) continue;
      int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      if (fd < 0) continue;
      int rc = connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa));
      if (rc == 0) {
        state[p] = PeerState::kAnswers;
        close(fd);
      } else if (errno == EINPROGRESS) {
        fds.push_back({fd, POLLOUT, 0});
        owner.push_back(p);
      } else {
        if (errno == ECONNREFUSED) refused[p] = true;
        close(fd);
      }
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + wait;
  size_t open = fds.size();
  while (open > 0) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    int rc = poll(fds.data(), fds.size(), static_cast<int>(left.count()));
    if (rc < 0 && errno == EINTR) continue;
    if (rc <= 0) break;
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      int err = 0;
      socklen_t len = sizeof(err);
      getsockopt(fds[i].fd, SOL_SOCKET, SO_ERROR, &err, &len);
      if (err == 0) state[owner[i]] = PeerState::kAnswers;
      if (err == ECONNREFUSED) refused[owner[i]] = true;
      close(fds[i].fd);
      fds[i].fd = -1;
      --open;
    }
  }
  for (auto& f : fds) {
    if (f.fd >= 0) close(f.fd);
  }
  for (size_t p = 0; p < peers.size(); ++p) {
    if (state[p] != PeerState::kAnswers && refused[p]) state[p] = PeerState::kProcessGone;
  }
  return state;
}

}  // namespace tandem::detail
