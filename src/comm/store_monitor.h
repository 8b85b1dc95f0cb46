#pragma once

// Note [Naming the ranks that did not arrive]
// Gloo and NCCL report a failed collective from the point of view of one socket ("Connection
// closed by peer 127.0.0.1:944", "Timed out waiting 300000ms for recv"), which does not say which
// rank is missing. Each rank therefore publishes, through the job's store, a heartbeat that
// carries the number of collectives it has issued, from a background thread every
// kHeartbeatInterval. When a collective fails, the failing rank reads every peer's heartbeat
// twice, a little more than two intervals apart:
//   - a heartbeat that did not move: that rank's process is gone or frozen;
//   - a collective count at or below the failed collective's number: that rank never issued it.
// The cost is one small store write per rank per interval and no work on the collective path
// beyond an atomic store. If the store itself is unreachable, rank 0 (its host) has died.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace paratrain {
namespace dist {
namespace detail {

constexpr std::chrono::milliseconds kHeartbeatInterval{500};

class StoreMonitor {
 public:
  /// `make_client` opens a private store client for the heartbeat thread.
  StoreMonitor(std::function<c10::intrusive_ptr<c10d::Store>()> make_client, int rank, int size);
  ~StoreMonitor();

  /// Called as each collective is issued: `issued` collectives so far.
  void set_issued(int64_t issued) { issued_.store(issued, std::memory_order_relaxed); }

  /// After collective `seq` failed: "; ranks that did not arrive: 1 (...)", or "" when every peer
  /// looks healthy or nothing can be told. Blocks for about 2.5 heartbeat intervals.
  std::string explain(int64_t seq);

 private:
  void run();

  std::function<c10::intrusive_ptr<c10d::Store>()> make_client_;
  const int rank_;
  const int size_;
  std::atomic<int64_t> issued_{0};
  std::mutex mutex_;
  std::condition_variable cv_;
  bool stop_ = false;  // guarded by mutex_
  std::thread thread_;
};

}  // namespace detail
}  // namespace dist
}  // namespace paratrain
