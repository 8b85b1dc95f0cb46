#pragma once

// Internal: the threads the fused optimizers split a step over. ATen's at::parallel_for is an
// inline OpenMP region, which code built without -fopenmp (as paratrain is) runs serially; and
// building with -fopenmp would put a second OpenMP runtime beside the one a PyTorch wheel
// bundles. So a step's chunks go to a small pool of our own: threads that live for the process,
// sleep between steps, and take chunks from one counter, the caller's thread among them. After a
// fork, the child's pool has no live workers; its steps then run on the calling thread alone
// (run() waits only for workers that joined the run).

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace paratrain {
namespace optim {
namespace detail {

class StepThreads {
 public:
  /// The process's pool.
  static StepThreads& instance();

  /// Runs fn(0) ... fn(n - 1) on `threads` threads, the caller's included, and returns when all
  /// have run. `fn` must not throw. One run at a time (a second caller waits).
  void run(int64_t n, int threads, const std::function<void(int64_t)>& fn);

 private:
  void work();
  void take_chunks();

  std::mutex run_mutex_;  // one run at a time
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0, next_ = 0;
  int wanted_ = 0;  // workers that take part in this run
  int joined_ = 0;  // workers that took part so far
  int busy_ = 0;    // workers still taking chunks
  uint64_t generation_ = 0;
};

}  // namespace detail
}  // namespace optim
}  // namespace paratrain
