#include "step_threads.h"

namespace paratrain {
namespace optim {
namespace detail {

// Never destroyed: a thread still stepping at exit (a detached trial function of the tuner, say)
// must not find it gone; its sleeping workers end with the process.
StepThreads& StepThreads::instance() {
  static StepThreads* pool = new StepThreads;
  return *pool;
}

// Chunks from the shared counter until none is left; under mutex_ on entry and exit.
void StepThreads::take_chunks() {
  std::unique_lock<std::mutex> lock(mutex_, std::adopt_lock);
  while (next_ < n_) {
    const int64_t i = next_++;
    lock.unlock();
    (*fn_)(i);
    lock.lock();
  }
  lock.release();
}

void StepThreads::work() {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    wake_.wait(lock, [&] { return generation_ != seen && joined_ < wanted_; });
    seen = generation_;
    ++joined_;
    ++busy_;
    lock.release();
    take_chunks();
    lock = std::unique_lock<std::mutex>(mutex_, std::adopt_lock);
    if (--busy_ == 0) {
      done_.notify_all();
    }
  }
}

void StepThreads::run(int64_t n, int threads, const std::function<void(int64_t)>& fn) {
  if (threads <= 1 || n <= 1) {
    for (int64_t i = 0; i < n; ++i) {
      fn(i);
    }
    return;
  }
  std::lock_guard<std::mutex> one_run(run_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  while (static_cast<int>(workers_.size()) < threads - 1) {
    workers_.emplace_back([this] { work(); });
  }
  fn_ = &fn;
  n_ = n;
  next_ = 0;
  wanted_ = threads - 1;
  joined_ = 0;
  ++generation_;
  wake_.notify_all();
  lock.release();
  take_chunks();
  lock = std::unique_lock<std::mutex>(mutex_, std::adopt_lock);
  // Every chunk is taken; wait for the workers still running theirs. A worker that wakes after
  // this finds no chunk left (joined_ may stay below wanted_): it runs nothing.
  done_.wait(lock, [&] { return busy_ == 0; });
  wanted_ = 0;
  fn_ = nullptr;
}

}  // namespace detail
}  // namespace optim
}  // namespace paratrain
