#include "worker_team.h"

#include "amp/autocast_state.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

namespace paratrain {
namespace detail {

namespace {

// The calling thread's current stream on every CUDA device; empty without CUDA. Streams are per
// thread, and at::ThreadLocalState does not carry them.
std::vector<c10::Stream> current_cuda_streams() {
  std::vector<c10::Stream> out;
  if (!at::hasCUDA()) {
    return out;
  }
  c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  for (c10::DeviceIndex d = 0; d < impl.deviceCount(); ++d) {
    out.push_back(impl.getStream(c10::Device(c10::DeviceType::CUDA, d)));
  }
  return out;
}

}  // namespace

WorkerTeam::WorkerTeam(size_t size, int intra_op_threads, bool uses_cuda)
    : jobs_(size, nullptr), uses_cuda_(uses_cuda) {
  threads_.reserve(size);
  for (size_t i = 0; i < size; ++i) {
    threads_.emplace_back([this, i, intra_op_threads] { loop(i, intra_op_threads); });
  }
}

WorkerTeam::~WorkerTeam() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : threads_) {
    t.join();
  }
}

void WorkerTeam::loop(size_t index, int intra_op_threads) {
  if (intra_op_threads > 0) {
    // OpenMP's thread count is per thread for threads OpenMP did not start, so this sets this
    // worker's share without touching the caller's.
    at::set_num_threads(intra_op_threads);
  }
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    wake_.wait(lock, [&] { return stop_ || jobs_[index] != nullptr; });
    if (stop_) {
      return;
    }
    const std::function<void()>* job = jobs_[index];
    const at::ThreadLocalState* state = state_.get();
    const at::ScalarType cpu_dtype = autocast_cpu_dtype_;
    const at::ScalarType gpu_dtype = autocast_gpu_dtype_;
    const std::vector<c10::Stream> streams = streams_;
    lock.unlock();
    std::exception_ptr error;
    try {
      at::ThreadLocalStateGuard guard(*state);
      // The caller's CUDA streams: its inputs were made on them and it reads the results on them
      // (a caller under a CUDAStreamGuard would otherwise race with work on the default stream).
      c10::MultiStreamGuard on_callers_streams(streams);
      // The caller's autocast dtypes, and a region of this task's own: autocast caches the casts
      // of weights per thread until the outermost region ends, and weights change in place
      // between tasks (optimizer steps, replica refreshes), so each task starts and ends one,
      // as PyTorch's parallel_apply does with its per-thread autocast context.
      amp::detail::set_autocast_dtype(c10::DeviceType::CPU, cpu_dtype);
      amp::detail::set_autocast_dtype(c10::DeviceType::CUDA, gpu_dtype);
      at::autocast::increment_nesting();
      struct EndRegion {
        ~EndRegion() {
          if (at::autocast::decrement_nesting() == 0) {
            at::autocast::clear_cache();
          }
        }
      } end_region;
      (*job)();
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    errors_[index] = error;
    jobs_[index] = nullptr;
    if (--pending_ == 0) {
      done_.notify_all();
    }
  }
}

std::vector<std::exception_ptr> WorkerTeam::run(const std::vector<std::function<void()>>& tasks) {
  TORCH_CHECK(tasks.size() <= threads_.size(), "WorkerTeam: ", tasks.size(),
              " tasks for a team of ", threads_.size(), " threads");
  std::unique_lock<std::mutex> lock(mutex_);
  errors_.assign(tasks.size(), nullptr);
  state_ = std::make_unique<at::ThreadLocalState>();
  autocast_cpu_dtype_ = amp::detail::autocast_dtype(c10::DeviceType::CPU);
  autocast_gpu_dtype_ = amp::detail::autocast_dtype(c10::DeviceType::CUDA);
  streams_ = uses_cuda_ ? current_cuda_streams() : std::vector<c10::Stream>{};
  pending_ = tasks.size();
  for (size_t i = 0; i < tasks.size(); ++i) {
    jobs_[i] = &tasks[i];
  }
  wake_.notify_all();
  done_.wait(lock, [&] { return pending_ == 0; });
  return errors_;
}
}  // namespace detail

}  // namespace paratrain
