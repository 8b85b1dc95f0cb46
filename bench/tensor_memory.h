#pragma once

// Live tensor bytes, as the allocator reports them while memory profiling is on (the hook
// torch.profiler's profile_memory uses): what a process holds in tensors, apart from what the C
// library keeps of freed memory, which resident memory counts too. Installed for a thread with
//   c10::DebugInfoGuard track(c10::DebugInfoKind::PROFILER_STATE, memory);
// allocations on other threads (the engine's own) are not counted. Accounts are per replica
// (`bench strategies`' DataParallel replicas share one process); the thread's is t_replica.

#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace paratrain {
namespace cli {

// Which replica the current thread works for; 0 for the caller.
inline thread_local int t_replica = 0;

// reportMemoryUsage's two totals are int64_t in libtorch 1.13 and size_t in 2.x: take whatever
// type this libtorch declares.
template <typename Method>
struct TotalsOf;
template <typename C, typename R, typename P, typename B, typename T, typename D>
struct TotalsOf<R (C::*)(P, B, T, T, D)> {
  using type = T;
};
using Totals = TotalsOf<decltype(&c10::MemoryReportingInfoBase::reportMemoryUsage)>::type;

class ReplicaMemory : public c10::MemoryReportingInfoBase {
 public:
  explicit ReplicaMemory(int replicas) : current_(replicas, 0), peak_(replicas, 0) {}

  void reportMemoryUsage(void* ptr, int64_t bytes, Totals, Totals, c10::Device) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (bytes > 0) {
      const size_t r = static_cast<size_t>(t_replica);
      auto stale = live_.find(ptr);  // freed on a thread this account does not see
      if (stale != live_.end()) {
        current_[stale->second.first] -= stale->second.second;
      }
      live_[ptr] = {r, bytes};
      current_[r] += bytes;
      peak_[r] = std::max(peak_[r], current_[r]);
      return;
    }
    auto it = live_.find(ptr);
    if (it != live_.end()) {
      current_[it->second.first] -= it->second.second;
      live_.erase(it);
    }
  }
  bool memoryProfilingEnabled() const override { return true; }

  // Moves `bytes` still live from one replica's account to another's, and restarts the peaks.
  void transfer(size_t from, size_t to, int64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    current_[from] -= bytes;
    current_[to] += bytes;
    peak_ = current_;
  }
  std::vector<int64_t> currents() {
    std::lock_guard<std::mutex> lock(mutex_);
    return current_;
  }
  std::vector<int64_t> peaks() {
    std::lock_guard<std::mutex> lock(mutex_);
    return peak_;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<void*, std::pair<size_t, int64_t>> live_;
  std::vector<int64_t> current_;
  std::vector<int64_t> peak_;
};

}  // namespace cli
}  // namespace paratrain
