#pragma once

// A fixed team of threads that run one task each, in parallel, and hand back every failure.
// DataParallel runs one replica per thread with it, the single-process pipeline one stage per
// thread. Threads persist across calls: starting threads on every forward and backward costs more
// than a small model's step (the MLP's is ~2 ms), and a persistent thread keeps its intra-op
// thread setting. std::async would start a fresh thread per call, and libtorch's at::launch pool
// is shared with the inter-op work of the whole process, so neither fits.

#include <ATen/ThreadLocalState.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace paratrain {
namespace detail {

class WorkerTeam {
 public:
  /// `size` threads. `intra_op_threads` > 0 sets each thread's intra-op (OpenMP) thread count
  /// once at start. `uses_cuda`: some task runs on a GPU, so each run hands the caller's CUDA
  /// streams to the tasks (reading them starts the CUDA driver, which an all-CPU team must not).
  explicit WorkerTeam(size_t size, int intra_op_threads = 0, bool uses_cuda = false);
  ~WorkerTeam();
  WorkerTeam(const WorkerTeam&) = delete;
  WorkerTeam& operator=(const WorkerTeam&) = delete;

  size_t size() const { return threads_.size(); }

  /// Runs tasks[i] on thread i, all at once, and returns when all have finished (the caller only
  /// waits, so every task gets the same intra-op share). The caller's thread-local state (grad
  /// and inference mode, autocast, dispatch keys) and its current CUDA streams are applied in each
  /// task. One caller at a time.
  /// Returns the exception of each task (null when it succeeded); the caller decides how to
  /// report them. At most size() tasks.
  std::vector<std::exception_ptr> run(const std::vector<std::function<void()>>& tasks);

 private:
  void loop(size_t index, int intra_op_threads);

  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::vector<std::thread> threads_;
  std::vector<const std::function<void()>*> jobs_;  // per thread, null when idle
  std::vector<std::exception_ptr> errors_;          // per task
  size_t pending_ = 0;
  std::unique_ptr<at::ThreadLocalState> state_;  // the caller's, during run()
  // Autocast's dtypes are per thread and not part of at::ThreadLocalState in libtorch 1.13.
  at::ScalarType autocast_cpu_dtype_ = at::kBFloat16;
  at::ScalarType autocast_gpu_dtype_ = at::kHalf;
  bool uses_cuda_;
  std::vector<c10::Stream> streams_;  // the caller's current CUDA streams, during run()
  bool stop_ = false;
};

}  // namespace detail
}  // namespace paratrain
