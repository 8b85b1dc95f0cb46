// TrainerOptions::offload: its rules, the free-space check before anything is built, and each
// rank's store.

#include "strategy.h"

#include "paratrain/base/option_error.h"
#include "paratrain/optim/offload.h"
#include "paratrain/train/trainer.h"
#include "util/strings.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

namespace paratrain::train_internal {

namespace {

// The ranks of this job that write to the same disk: this host's (torchrun's LOCAL_WORLD_SIZE),
// or, without it, every rank of the group (the worst case).
int64_t ranks_on_this_host(const TrainerOptions& o) {
  const char* local = std::getenv("LOCAL_WORLD_SIZE");
  if (local != nullptr && std::atoll(local) > 0) {
    return std::atoll(local);
  }
  return o.process_group() != nullptr ? o.process_group()->size() : 1;
}

}  // namespace

void check_offload_options(const TrainerOptions& o) {
  const TrainOffloadOptions& off = o.offload();
  if (!off.any()) {
    PARATRAIN_CHECK_OPTION(off.dir().empty(), "offload", "offload dir '", off.dir(),
                           "' says where offloaded state goes, but nothing is offloaded: add "
                           "optimizer (and gradients, params)");
    return;
  }
  const bool fsdp = o.strategy() == Strategy::kFSDP;
  const bool zero = o.strategy() == Strategy::kDDP && o.zero();
  PARATRAIN_CHECK_OPTION(
      fsdp || zero, "offload", "offload moves sharded state out of memory, and strategy ",
      to_string(o.strategy()),
      o.strategy() == Strategy::kDDP
          ? " keeps the whole state on every rank: add zero (the optimizer's state sharded) or use "
            "strategy fsdp"
          : " shards nothing: use strategy fsdp, or ddp with zero");
  PARATRAIN_CHECK_OPTION(fsdp || (!off.gradients() && !off.params()), "offload",
                         "zero shards the optimizer's state only: offload gradients and params "
                         "with strategy fsdp");
  PARATRAIN_CHECK_OPTION(off.optimizer(), "offload",
                         "offloaded gradients and parameters are read and written by the "
                         "optimizer's step in the store: offload the optimizer too");
  PARATRAIN_CHECK_OPTION(o.optimizer().kind() != "sgd", "offload",
                         "offload keeps the moments of adam and adamw; sgd's momentum stays in "
                         "memory: choose adam or adamw");
  // On a device the optimizer's step runs on the CPU with its state in host memory or the files
  // (ZeRO-Offload, ZeRO-Infinity's optimizer tier); FSDP's shards and reduced gradients stay on
  // the device, where its all-gathers and reduce-scatters need them.
  PARATRAIN_CHECK_OPTION(o.device().is_cpu() || (!off.gradients() && !off.params()), "offload",
                         "on device ", o.device().str(),
                         " offload takes the optimizer (its state in host memory or the files, "
                         "Adam on the CPU); gradients and params stay on the device: offload "
                         "optimizer alone, or train on the CPU");
  PARATRAIN_CHECK_OPTION(o.mesh().pp() == 1, "offload",
                         "offload does not take pipeline stages (pp ", o.mesh().pp(),
                         "): their tied embedding is read outside the steps the store streams");
  if (!off.dir().empty()) {
    const std::string problem = optim::offload_dir_problem(off.dir());
    PARATRAIN_CHECK_OPTION(problem.empty(), "offload", problem);
  }
}

// An upper bound of what one rank writes: its share of every offloaded fp32 array, with a page
// per block. FSDP shards over world / dp_replicate ranks (HSDP's replicas hold the same shards);
// ZeRO gives each rank whole tensors, so a rank may get the largest one on top of its share.
int64_t offload_bytes_per_rank(const TrainerOptions& o, const torch::nn::Sequential& model) {
  int64_t numel = 0, largest = 0, tensors = 0;
  for (const auto& p : model->parameters()) {
    numel += p.numel();
    largest = std::max<int64_t>(largest, p.numel());
    ++tensors;
  }
  const int64_t world = o.process_group() != nullptr ? o.process_group()->size() : 1;
  const bool zero = o.strategy() == Strategy::kDDP;
  const int64_t sharers = std::max<int64_t>(1, world / std::max(1, o.mesh().dp_replicate()));
  const int64_t share = (numel + sharers - 1) / sharers + (zero ? largest : 0);
  const TrainOffloadOptions& off = o.offload();
  const int64_t arrays =
      (off.optimizer() ? 2 : 0) + (off.gradients() ? 1 : 0) + (off.params() ? 1 : 0);  // fp32 each
  const int64_t blocks = zero ? tensors : static_cast<int64_t>(model->children().size());
  return (share * 4 + blocks * 4096) * arrays;
}

void check_offload_space(const TrainerOptions& o, const torch::nn::Sequential& model) {
  const TrainOffloadOptions& off = o.offload();
  if (!off.any() || off.dir().empty()) {
    return;
  }
  const int64_t per_rank = offload_bytes_per_rank(o, model);
  const int64_t ranks = ranks_on_this_host(o);
  const int64_t free = optim::offload_free_bytes(off.dir());
  PARATRAIN_CHECK_OPTION(per_rank * ranks <= free, "offload", "offload dir '", off.dir(), "' has ",
                         paratrain::detail::gib(free), " free, and offloading needs ",
                         paratrain::detail::gib(per_rank * ranks), " (",
                         paratrain::detail::gib(per_rank), " per rank, ", ranks,
                         " ranks on this host): free space or choose another directory");
}

std::shared_ptr<optim::OffloadStore> make_offload_store(const TrainerOptions& o) {
  if (!o.offload().any()) {
    return nullptr;
  }
  const int rank = o.process_group() != nullptr ? o.process_group()->rank() : 0;
  return std::make_shared<optim::OffloadStore>(
      optim::OffloadOptions().dir(o.offload().dir()).owner("rank " + std::to_string(rank)));
}

}  // namespace paratrain::train_internal
