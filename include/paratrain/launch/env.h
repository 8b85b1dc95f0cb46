#pragma once

// Rank discovery: who am I in the job, read from the environment the launcher left us.
//
// The torchrun environment contract (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
// MASTER_ADDR, MASTER_PORT) is the one interface between `paratrain launch` and everything else.
// Jobs started by mpirun or Slurm speak their own dialects; we read those too, first match wins:
//   1. torchrun / paratrain launch: RANK and WORLD_SIZE
//   2. Open MPI (mpirun):           OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, ..._LOCAL_RANK
//   3. Slurm (srun):                SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID
//   4. nothing set:                 a world of one process.

#include <functional>
#include <string>

namespace paratrain {
namespace dist {

/// Port used when MASTER_PORT is not set; the same as torchrun's.
constexpr int kDefaultMasterPort = 29500;

struct RankInfo {
  int rank = 0;              ///< global rank, 0 .. world_size-1
  int world_size = 1;        ///< number of processes in the job
  int local_rank = 0;        ///< rank on this node, 0 .. local_world_size-1 (picks the device)
  int local_world_size = 1;  ///< processes on this node
  int group_rank = 0;        ///< node rank (torchrun's GROUP_RANK)
  std::string master_addr;   ///< host of rank 0's store; empty when nobody said
  int master_port = kDefaultMasterPort;
  /// Where the answer came from: "torchrun", "openmpi", "slurm" or "default".
  std::string source = "default";

  /// True when every rank of the job runs on this node.
  bool single_node() const { return local_world_size == world_size; }
};

/// Reads the process environment. Throws c10::Error naming the variable for values that are not
/// integers, a world size < 1, a rank outside [0, world_size), or a local rank outside its range.
RankInfo discover_rank_info();

/// The same, reading variables through `getenv` (returns nullptr for unset); used by tests.
RankInfo discover_rank_info(const std::function<const char*(const char*)>& getenv);

/// Parses a whole decimal integer; throws c10::Error naming `what` otherwise.
int parse_int(const std::string& text, const std::string& what);

}  // namespace dist
}  // namespace paratrain
