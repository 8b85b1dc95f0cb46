#pragma once

// Join: uneven inputs across ranks, as torch.distributed.algorithms.Join. Ranks whose data runs
// out keep taking part in the collectives of the ranks that still train, so the job neither hangs
// nor loses their gradients.
//
//   paratrain::Join join(pg, [&] {                   // one step on an empty batch
//     auto out = ddp.forward(x.narrow(0, 0, 0));     // same layers, zero rows
//     (out.sum() * 0).backward();                    // DDP's allreduces, with zero gradients
//     optimizer.step();                              // ZeRO's broadcasts (and its shard's step)
//   });
//   for (auto& batch : my_uneven_shard) {
//     join.notify();                                 // "I still have data", once per step
//     ... forward, backward, step ...
//   }
//   join.join();                                     // shadow the others until all are done
//
// Note [How Join shadows]
// Each step starts with one allreduce of the number of ranks that still have data: a rank with
// data adds 1 (notify), a joined rank adds 0 and, while the sum is not zero, runs the shadow step,
// which issues the same collectives in the same order as a real step because it runs the same
// code on zero rows: DDP's buffer broadcast and bucket allreduces, SyncBatchNorm's allgather
// (with a count of zero) and allreduce, ZeroRedundancyOptimizer's broadcasts. A joined rank
// contributes zero gradients, and DDP still divides by the whole world size, as PyTorch's Join
// with divide_by_initial_world_size=True (its default). BatchNorm on zero rows leaves its running
// statistics unchanged; SyncBatchNorm updates them from the other ranks' rows, so they stay equal.
//
// The shadow step must call the same collectives as a real step: with a loss that averages over
// rows, use a sum times zero (an empty mean is NaN).

#include "paratrain/comm/process_group.h"

#include <cstdint>
#include <functional>

namespace paratrain {

class Join {
 public:
  /// `shadow_step` runs one step on an empty batch (see above). Throws c10::Error for a null
  /// group or step.
  Join(dist::ProcessGroupPtr group, std::function<void()> shadow_step);
  Join(const Join&) = delete;
  Join& operator=(const Join&) = delete;

  /// Call at the start of every step while this rank has data: a collective. Returns the number
  /// of ranks that still have data (this one included).
  int64_t notify();
  /// This rank is out of data: runs the shadow step as long as another rank still trains, and
  /// returns when every rank has joined. Returns the number of shadow steps run. After it, this
  /// Join is done: notify() and join() throw.
  int64_t join();

 private:
  int64_t count(int64_t mine);

  dist::ProcessGroupPtr group_;
  std::function<void()> shadow_step_;
  bool joined_ = false;
};

}  // namespace paratrain
