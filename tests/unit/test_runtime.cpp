#include <gtest/gtest.h>
#include <cstdlib>
#include "tandem/runtime.h"

namespace {
struct EnvGuard {
  std::vector<std::string> names;
  void set(const char* n, const char* v) { setenv(n, v, 1); names.push_back(n); }
  ~EnvGuard() { for (auto& n : names) unsetenv(n.c_str()); }
};
}  // namespace

TEST(ProcessInfo, ReadsMpirunEnvironment) {
  EnvGuard g;
  g.set("OMPI_COMM_WORLD_SIZE", "4");
  g.set("OMPI_COMM_WORLD_RANK", "3");
  g.set("OMPI_COMM_WORLD_LOCAL_RANK", "1");
  g.set("OMPI_COMM_WORLD_LOCAL_SIZE", "2");
  auto p = tandem::detect_process_info();
  EXPECT_EQ(p.launcher, "mpirun");
  EXPECT_EQ(p.world_size, 4);
  EXPECT_EQ(p.rank, 3);
  EXPECT_EQ(p.local_rank, 1);
  EXPECT_EQ(p.local_size, 2);
}

TEST(ProcessInfo, ReadsSlurmEnvironment) {
  EnvGuard g;
  g.set("SLURM_NTASKS", "8");
  g.set("SLURM_PROCID", "5");
  g.set("SLURM_LOCALID", "1");
  g.set("SLURM_TASKS_PER_NODE", "4(x2)");
  auto p = tandem::detect_process_info();
  EXPECT_EQ(p.launcher, "srun");
  EXPECT_EQ(p.world_size, 8);
  EXPECT_EQ(p.rank, 5);
  EXPECT_EQ(p.local_rank, 1);
  EXPECT_EQ(p.local_size, 4);
}

TEST(ProcessInfo, ReadsPlainEnvironment) {
  EnvGuard g;
  g.set("WORLD_SIZE", "3");
  g.set("RANK", "2");
  g.set("LOCAL_RANK", "0");
  g.set("LOCAL_WORLD_SIZE", "1");
  auto p = tandem::detect_process_info();
  EXPECT_EQ(p.launcher, "env");
  EXPECT_EQ(p.world_size, 3);
  EXPECT_EQ(p.rank, 2);
  EXPECT_EQ(p.local_rank, 0);
}

TEST(ProcessInfo, RejectsInconsistentEnvironment) {
  EnvGuard g;
  g.set("WORLD_SIZE", "2");
  g.set("RANK", "2");
  EXPECT_THROW(tandem::detect_process_info(), std::invalid_argument);
  g.set("RANK", "x1");
  EXPECT_THROW(tandem::detect_process_info(), std::invalid_argument);
}

TEST(ProcessInfo, DefaultsToSingleProcess) {
  auto p = tandem::detect_process_info();
  EXPECT_EQ(p.world_size, 1);
  EXPECT_EQ(p.rank, 0);
  EXPECT_EQ(p.launcher, "none");
}
