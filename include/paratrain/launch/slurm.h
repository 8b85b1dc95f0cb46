#pragma once

// Slurm allocations: where this node sits in a job, read from the variables srun and sbatch set,
// so that `paratrain launch` needs no --nnodes, --node-rank or --master-addr inside an allocation.

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace paratrain {
namespace dist {

/// Expands a Slurm host list as `scontrol show hostnames` does: "node[01-04,07],gpu1" ->
/// node01 node02 node03 node04 node07 gpu1. A range keeps the width of its lower bound
/// ("n[01-3]" -> n01 n02 n03); several bracket groups in one name multiply ("a[1-2]b[3-4]" -> a1b3
/// a1b4 a2b3 a2b4). Throws c10::Error with one line naming the list and what is wrong in it
/// (unbalanced brackets, an empty or reversed range, text after a bracket group).
std::vector<std::string> expand_hostlist(const std::string& list);

/// This node's place in a Slurm allocation.
struct SlurmPlacement {
  std::string job_id;
  /// SLURM_STEP_NODELIST (under srun: the step's nodes), else SLURM_JOB_NODELIST, expanded.
  std::vector<std::string> hosts;
  /// SLURM_STEP_NUM_NODES, SLURM_NNODES or SLURM_JOB_NUM_NODES; else the list's size.
  int nnodes = 1;
  int node_rank = 0;        ///< SLURM_NODEID
  std::string master_addr;  ///< the list's first host
};

/// The placement the variables `env` describe: nullopt unless SLURM_JOB_ID is set. Throws
/// c10::Error with one line for a node list that does not parse, a node count that disagrees with
/// it, a SLURM_NODEID outside it, several nodes outside an srun step (a batch script runs on the
/// first node only), or an srun step of more tasks than nodes.
std::optional<SlurmPlacement> slurm_placement(const std::map<std::string, std::string>& env);

/// The process's own environment, for slurm_placement.
std::map<std::string, std::string> current_environment();

}  // namespace dist
}  // namespace paratrain
