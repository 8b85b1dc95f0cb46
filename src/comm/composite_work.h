#pragma once

// Internal: a Work made of several operations that complete as one, then a finishing step.

#include "paratrain/comm/process_group.h"

#include <ATen/ATen.h>

#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace paratrain {
namespace dist {
namespace detail {

// Several operations that complete as one (the sends and receives of an exchange), then a
// finishing step that runs once, after all of them succeeded. c10d's Gloo sends and receives
// report completion only from their own wait(), so a thread of the work's own waits for them:
// is_completed() then turns true by itself, as for the engine's collectives, without blocking.
class CompositeWork : public Work {
 public:
  CompositeWork(std::vector<WorkPtr> parts, std::function<void()> finish)
      : state_(std::make_shared<State>()) {
    state_->parts = std::move(parts);
    state_->finish = std::move(finish);
    waiter_ = std::thread([state = state_] { state->run(); });
  }
  ~CompositeWork() override {
    if (waiter_.joinable()) {
      waiter_.join();  // at most the parts' timeouts away
    }
  }
  CompositeWork(const CompositeWork&) = delete;
  CompositeWork& operator=(const CompositeWork&) = delete;

  void wait() override {
    std::unique_lock<std::mutex> lock(state_->mutex);
    state_->changed.wait(lock, [this] { return state_->done; });
    if (state_->error) {
      std::rethrow_exception(state_->error);  // the part's CollectiveError names the peer
    }
  }

  bool is_completed() override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->done;
  }

 private:
  struct State {
    std::mutex mutex;
    std::condition_variable changed;
    bool done = false;             // guarded by mutex
    std::exception_ptr error;      // guarded by mutex
    std::vector<WorkPtr> parts;    // the waiter's alone until done
    std::function<void()> finish;  // the waiter's alone until done

    void run() {
      std::exception_ptr failure;
      try {
        at::NoGradGuard no_grad;  // a new thread records autograd by default
        for (auto& part : parts) {
          part->wait();
        }
        if (finish) {
          finish();
        }
      } catch (...) {
        failure = std::current_exception();
      }
      parts.clear();  // the tensors they hold
      finish = nullptr;
      {
        std::lock_guard<std::mutex> lock(mutex);
        error = failure;
        done = true;
      }
      changed.notify_all();
    }
  };
  std::shared_ptr<State> state_;
  std::thread waiter_;
};

}  // namespace detail
}  // namespace dist
}  // namespace paratrain
