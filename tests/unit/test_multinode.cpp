// Multi-node pieces that need no second host: the launcher's network selection, the
// reachability probe (runtime/peer_probe.h) and the host layout of a single process. The real
// thing runs in tests/e2e/multinode_*.sh across network-namespace hosts.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <thread>

#include "runtime/peer_probe.h"
#include "tandem/launcher.h"
#include "tandem/runtime.h"

namespace tandem {
namespace {

using std::chrono::milliseconds;

bool has_sequence(const std::vector<std::string>& v, const std::vector<std::string>& seq) {
  return std::search(v.begin(), v.end(), seq.begin(), seq.end()) != v.end();
}

TEST(Launcher, NetworkSelectionGoesToBothTcpChannelsAndTheWorkers) {
  LaunchOptions o;
  o.nprocs = 4;
  o.hostfile = "hosts";
  o.net_if = "10.1.0.0/16,eth1";
  auto cmd = mpirun_command(o, {"prog"});
  EXPECT_TRUE(has_sequence(cmd, {"--hostfile", "hosts", "--mca", "btl", "self,vader,tcp"}));
  EXPECT_TRUE(has_sequence(cmd, {"--mca", "btl_tcp_if_include", "10.1.0.0/16,eth1"}));
  EXPECT_TRUE(has_sequence(cmd, {"--mca", "oob_tcp_if_include", "10.1.0.0/16,eth1"}));
  EXPECT_TRUE(has_sequence(cmd, {"-x", "TANDEM_NET_IF=10.1.0.0/16,eth1"}));
  EXPECT_EQ(cmd.back(), "prog");
}

TEST(Launcher, NetworkSelectionFromEnvironmentAndNoneByDefault) {
  LaunchOptions o;
  unsetenv("TANDEM_NET_IF");
  auto plain = mpirun_command(o, {"prog"});
  EXPECT_EQ(std::count(plain.begin(), plain.end(), "btl_tcp_if_include"), 0);
  setenv("TANDEM_NET_IF", "ib0", 1);
  auto cmd = mpirun_command(o, {"prog"});
  unsetenv("TANDEM_NET_IF");
  EXPECT_TRUE(has_sequence(cmd, {"--mca", "btl_tcp_if_include", "ib0"}));
}

TEST(Launcher, RejectsNetworkSelectionThatIsNoInterfaceList) {
  LaunchOptions o;
  o.net_if = "eth0 --mca plm_rsh_agent evil";
  try {
    mpirun_command(o, {"prog"});
    FAIL() << "accepted a selection with spaces";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("interface names or subnets"), std::string::npos) << e.what();
  }
}

TEST(PeerProbe, ListenerAnswersAndAClosedPortIsAProcessGone) {
  int port = 0;
  {
    detail::ProbeListener l;
    port = l.port();
    ASSERT_GT(port, 0);
    auto s = detail::probe_peers({{{"127.0.0.1"}, port}}, milliseconds(2000));
    EXPECT_EQ(s.at(0), detail::PeerState::kAnswers);
  }
  auto s = detail::probe_peers({{{"127.0.0.1"}, port}}, milliseconds(2000));
  EXPECT_EQ(s.at(0), detail::PeerState::kProcessGone);
}

// A listener whose accept queue is full drops new SYNs: a peer that never answers, on loopback.
TEST(PeerProbe, NoAnswerIsUnreachableWithinTheWait) {
  int full = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(sa);
  ASSERT_EQ(bind(full, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  ASSERT_EQ(listen(full, 0), 0);
  ASSERT_EQ(getsockname(full, reinterpret_cast<sockaddr*>(&sa), &len), 0);
  std::vector<int> fillers;
  for (int i = 0; i < 3; ++i) {
    fillers.push_back(socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0));
    connect(fillers.back(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa));
  }
  std::this_thread::sleep_for(milliseconds(100));
  detail::ProbeListener l;
  auto t0 = std::chrono::steady_clock::now();
  auto s = detail::probe_peers({{{"127.0.0.1"}, ntohs(sa.sin_port)}, {{"127.0.0.1"}, l.port()}}, milliseconds(300));
  auto waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int fd : fillers) close(fd);
  close(full);
  EXPECT_EQ(s.at(0), detail::PeerState::kUnreachable);
  EXPECT_EQ(s.at(1), detail::PeerState::kAnswers);  // each peer on its own
  EXPECT_GE(waited, 0.25);
  EXPECT_LT(waited, 2.0);
}

TEST(PeerProbe, LocalAddressesHonourTheSelection) {
  auto all = detail::local_addresses("");
  EXPECT_EQ(std::count(all.begin(), all.end(), "127.0.0.1"), 0);  // loopback never
  EXPECT_EQ(detail::local_addresses("0.0.0.0/0"), all);
  for (const auto& a : all) EXPECT_EQ(detail::local_addresses(a + "/32"), std::vector<std::string>{a});
  EXPECT_TRUE(detail::local_addresses("lo").empty());
  EXPECT_TRUE(detail::local_addresses("127.0.0.0/8,no-such-if").empty());
}

TEST(Runtime, OneProcessIsOneHost) {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "WORLD_SIZE"}) unsetenv(v);
  RuntimeOptions o;
  o.device = "cpu";
  o.backend = "self";
  Runtime rt(o);
  ASSERT_EQ(rt.hosts().size(), 1u);
  EXPECT_EQ(rt.node_rank(), 0);
  EXPECT_EQ(rt.hosts()[0].ranks, std::vector<int>{0});
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  EXPECT_EQ(rt.layout().rfind(std::string("1 host: ") + name, 0), 0u) << rt.layout();
  EXPECT_NE(rt.layout().find(" rank 0"), std::string::npos) << rt.layout();
  EXPECT_EQ(rt.unreachable_peers(), "");
}

}  // namespace
}  // namespace tandem
