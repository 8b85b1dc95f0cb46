// Rank discovery and the launcher's argument checks, in process.

#include "paratrain/launch/env.h"
#include "paratrain/launch/launch.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <map>

namespace paratrain {
namespace dist {
namespace {

RankInfo discover(const std::map<std::string, std::string>& vars) {
  return discover_rank_info([&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

std::string error_of(const std::map<std::string, std::string>& vars) {
  try {
    discover(vars);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

TEST(RankDiscovery, NothingSetIsAWorldOfOne) {
  RankInfo info = discover({});
  EXPECT_EQ(info.source, "default");
  EXPECT_EQ(info.rank, 0);
  EXPECT_EQ(info.world_size, 1);
  EXPECT_EQ(info.local_rank, 0);
  EXPECT_TRUE(info.master_addr.empty());
  EXPECT_EQ(info.master_port, 29500);
}

TEST(RankDiscovery, TorchrunContract) {
  RankInfo info = discover({{"RANK", "5"},
                            {"WORLD_SIZE", "8"},
                            {"LOCAL_RANK", "1"},
                            {"LOCAL_WORLD_SIZE", "4"},
                            {"GROUP_RANK", "1"},
                            {"MASTER_ADDR", "node0"},
                            {"MASTER_PORT", "1234"}});
  EXPECT_EQ(info.source, "torchrun");
  EXPECT_EQ(info.rank, 5);
  EXPECT_EQ(info.world_size, 8);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 4);
  EXPECT_EQ(info.group_rank, 1);
  EXPECT_EQ(info.master_addr, "node0");
  EXPECT_EQ(info.master_port, 1234);
  EXPECT_FALSE(info.single_node());
}

TEST(RankDiscovery, OpenMpi) {
  RankInfo info = discover({{"OMPI_COMM_WORLD_RANK", "2"},
                            {"OMPI_COMM_WORLD_SIZE", "3"},
                            {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                            {"OMPI_COMM_WORLD_LOCAL_SIZE", "3"}});
  EXPECT_EQ(info.source, "openmpi");
  EXPECT_EQ(info.rank, 2);
  EXPECT_EQ(info.world_size, 3);
  EXPECT_EQ(info.local_rank, 2);
  EXPECT_TRUE(info.single_node());
}

TEST(RankDiscovery, Slurm) {
  RankInfo info = discover({{"SLURM_PROCID", "3"},
                            {"SLURM_NTASKS", "4"},
                            {"SLURM_LOCALID", "1"},
                            {"SLURM_NTASKS_PER_NODE", "2"},
                            {"SLURM_NODEID", "1"}});
  EXPECT_EQ(info.source, "slurm");
  EXPECT_EQ(info.rank, 3);
  EXPECT_EQ(info.world_size, 4);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 2);
  EXPECT_EQ(info.group_rank, 1);
}

TEST(RankDiscovery, FirstMatchWins) {
  // Inside a Slurm allocation under mpirun under paratrain launch: torchrun's variables win.
  RankInfo info = discover({{"RANK", "1"},
                            {"WORLD_SIZE", "2"},
                            {"OMPI_COMM_WORLD_RANK", "0"},
                            {"OMPI_COMM_WORLD_SIZE", "5"},
                            {"SLURM_PROCID", "7"},
                            {"SLURM_NTASKS", "9"}});
  EXPECT_EQ(info.source, "torchrun");
  EXPECT_EQ(info.rank, 1);
  EXPECT_EQ(info.world_size, 2);
  info = discover({{"OMPI_COMM_WORLD_RANK", "0"},
                   {"OMPI_COMM_WORLD_SIZE", "5"},
                   {"SLURM_PROCID", "7"},
                   {"SLURM_NTASKS", "9"}});
  EXPECT_EQ(info.source, "openmpi");
  EXPECT_EQ(info.world_size, 5);
}

TEST(RankDiscovery, BadValuesNameTheVariable) {
  EXPECT_NE(
      error_of({{"RANK", "0"}, {"WORLD_SIZE", "0"}}).find("WORLD_SIZE=0 is not a valid world size"),
      std::string::npos);
  EXPECT_NE(error_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}}).find("RANK=2 is out of range"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "-1"}, {"WORLD_SIZE", "2"}}).find("RANK=-1 is out of range"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "one"}, {"WORLD_SIZE", "2"}}).find("RANK='one' is not an integer"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}})
                .find("MASTER_PORT=70000 is not a TCP port"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "3"}})
                .find("LOCAL_RANK=3 is out of range"),
            std::string::npos);
  EXPECT_NE(error_of({{"SLURM_PROCID", "4"}, {"SLURM_NTASKS", "4"}}).find("SLURM_PROCID=4"),
            std::string::npos);
}

TEST(DeviceList, Parses) {
  EXPECT_EQ(parse_device_list("0,1,3"), (std::vector<int>{0, 1, 3}));
  EXPECT_EQ(parse_device_list("2"), (std::vector<int>{2}));
  // The names train's --devices uses for the same GPUs.
  EXPECT_EQ(parse_device_list("cuda:0,cuda:1,3"), (std::vector<int>{0, 1, 3}));
}

TEST(DeviceList, RejectsBadLists) {
  auto message = [](const std::string& text) {
    try {
      parse_device_list(text);
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string();
  };
  EXPECT_NE(message("0,1,1").find("lists GPU 1 twice"), std::string::npos);
  EXPECT_NE(message("0,x").find("'x' is not a GPU index"), std::string::npos);
  EXPECT_NE(message("0,-1").find("'-1' is not a GPU index"), std::string::npos);
  EXPECT_NE(message("0,,1").find("'' is not a GPU index"), std::string::npos);
  EXPECT_NE(message("cpu,1").find("'cpu' is not a GPU index"), std::string::npos);
  EXPECT_NE(message("cuda:").find("'cuda:' is not a GPU index"), std::string::npos);
  EXPECT_NE(message("cuda:0,0").find("lists GPU 0 twice"), std::string::npos);
  EXPECT_NE(message("").find("empty"), std::string::npos);
  EXPECT_NE(message("0,1,").find("ends with a comma"), std::string::npos);
}

TEST(FindProgram, PathAndMissing) {
  EXPECT_EQ(find_program("/bin/sh"), "/bin/sh");
  EXPECT_FALSE(find_program("sh").empty());
  EXPECT_TRUE(find_program("surely-no-such-program-xyz").empty());
  EXPECT_TRUE(find_program("/nonexistent/prog").empty());
  EXPECT_TRUE(find_program("/etc").empty());  // a directory is not a program
}

}  // namespace
}  // namespace dist
}  // namespace paratrain
