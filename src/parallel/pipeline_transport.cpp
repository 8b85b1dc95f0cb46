// Pipeline transports: how stages pass activations and gradients, between threads of one process
// (ThreadTransport, for Pipeline) and between processes over a process group
// (ProcessGroupTransport, for DistributedPipeline).

#include "pipeline_internal.h"

#include <torch/torch.h>

#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>
#include <tuple>

namespace paratrain {
namespace pipeline {

namespace {

std::string what_travels(bool grad) {
  return grad ? "gradient" : "activation";
}

class ThreadTransport : public Transport {
 public:
  explicit ThreadTransport(std::chrono::milliseconds timeout) : timeout_(timeout) {}

  void send(
      int64_t from, int64_t to, int64_t micro_batch, bool grad, const at::Tensor& tensor) override {
    (void)from;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      box_[std::make_tuple(to, micro_batch, grad)] = tensor;
    }
    cv_.notify_all();
  }

  at::Tensor recv(int64_t from, int64_t to, int64_t micro_batch, bool grad) override {
    const auto key = std::make_tuple(to, micro_batch, grad);
    std::unique_lock<std::mutex> lock(mutex_);
    const bool ready =
        cv_.wait_for(lock, timeout_, [&] { return box_.count(key) > 0 || !aborted_.empty(); });
    if (!aborted_.empty()) {
      throw internal::StageAborted(aborted_);
    }
    TORCH_CHECK(ready, "pipeline: stage ", to, " waited ", timeout_.count(), " ms for the ",
                what_travels(grad), " of micro-batch ", micro_batch, " from stage ", from,
                " (PipelineOptions().timeout)");
    at::Tensor t = std::move(box_[key]);
    box_.erase(key);
    return t;
  }

  void abort(const std::string& why) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      aborted_ = why;
    }
    cv_.notify_all();
  }

 private:
  std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<std::tuple<int64_t, int64_t, bool>, at::Tensor> box_;
  std::string aborted_;
};

constexpr int64_t kMaxDims = 8;
constexpr int64_t kHeaderLength = 2 + kMaxDims;  // dtype, number of dims, sizes

class ProcessGroupTransport : public Transport {
 public:
  ProcessGroupTransport(dist::ProcessGroupPtr pg,
                        std::vector<int> ranks,
                        torch::Device device,
                        Schedule schedule)
      : pg_(std::move(pg)), ranks_(std::move(ranks)), wire_(torch::kCPU) {
    TORCH_CHECK(pg_ != nullptr, "pipeline: the process group is null");
    for (size_t i = 0; i < ranks_.size(); ++i) {
      TORCH_CHECK(ranks_[i] >= 0 && ranks_[i] < pg_->size(), "pipeline: stage ", i, " is on rank ",
                  ranks_[i], ", which is not a rank of the group (0..", pg_->size() - 1, ")");
    }
    wire_ = choose_wire(device, schedule);
  }

  void send(
      int64_t from, int64_t to, int64_t micro_batch, bool grad, const at::Tensor& tensor) override {
    (void)from;
    (void)micro_batch;
    check_not_broken();
    TORCH_CHECK(tensor.dim() <= kMaxDims, "pipeline: cannot send a ", tensor.dim(),
                "-d tensor between stages (at most ", kMaxDims, " dims)");
    at::Tensor data = tensor.contiguous().to(wire_device());
    at::Tensor header = torch::zeros({kHeaderLength}, torch::kLong);
    auto h = header.accessor<int64_t, 1>();
    h[0] = static_cast<int64_t>(data.scalar_type());
    h[1] = data.dim();
    for (int64_t d = 0; d < data.dim(); ++d) {
      h[2 + d] = data.size(d);
    }
    header = header.to(wire_device());
    const int dst = ranks_[static_cast<size_t>(to)];
    const int tag = grad ? 1 : 0;
    pending_.push_back({pg_->send(header, dst, tag), header});
    pending_.push_back({pg_->send(data, dst, tag), data});
  }

  at::Tensor recv(int64_t from, int64_t to, int64_t micro_batch, bool grad) override {
    (void)to;
    (void)micro_batch;
    check_not_broken();
    const int src = ranks_[static_cast<size_t>(from)];
    const int tag = grad ? 1 : 0;
    at::Tensor header =
        torch::zeros({kHeaderLength}, torch::TensorOptions(torch::kLong).device(wire_device()));
    pg_->recv(header, src, tag)->wait();
    header = header.cpu();
    auto h = header.accessor<int64_t, 1>();
    TORCH_CHECK(h[1] >= 0 && h[1] <= kMaxDims, "pipeline: a malformed message header from rank ",
                src, " (", h[1], " dims)");
    TORCH_CHECK(h[0] >= 0 && h[0] < static_cast<int64_t>(c10::ScalarType::NumOptions),
                "pipeline: a malformed message header from rank ", src, " (dtype ", h[0], ")");
    const auto dtype = static_cast<c10::ScalarType>(h[0]);
    TORCH_CHECK(dtype != c10::ScalarType::Undefined && !c10::isQIntType(dtype),
                "pipeline: a malformed message header from rank ", src, " (dtype ", h[0], ")");
    std::vector<int64_t> sizes(h.data() + 2, h.data() + 2 + h[1]);
    TORCH_CHECK(std::all_of(sizes.begin(), sizes.end(), [](int64_t n) { return n >= 0; }),
                "pipeline: a malformed message header from rank ", src, " (sizes ",
                c10::IntArrayRef(sizes), ")");
    at::Tensor data =
        torch::empty(sizes, torch::TensorOptions().dtype(dtype).device(wire_device()));
    pg_->recv(data, src, tag)->wait();
    return data;
  }

  void flush() override {
    // Cleared whatever happens: a failed send must not resurface in the next step.
    std::vector<std::pair<dist::WorkPtr, at::Tensor>> pending;
    pending.swap(pending_);
    for (auto& p : pending) {
      p.first->wait();
    }
  }

  // After a failure: forget the sends. Messages of the failed step may still be on their way (or
  // a header without its data), and the header does not say which step it belongs to, so a later
  // step would take them for its own: every later send or recv refuses instead.
  void abort(const std::string& why) override {
    pending_.clear();
    broken_ = why;
  }

 private:
  void check_not_broken() const {
    TORCH_CHECK(broken_.empty(), "pipeline: an earlier step failed on this rank (", broken_,
                "), so the stages' messages are out of step; create the process group and the "
                "DistributedPipeline anew");
  }

  // Where messages travel. It depends only on the group's engines and the schedule, never on
  // this rank's device alone, so that both ends of every message agree (a cuda stage next to a cpu
  // stage on a routed group). A group with a CPU engine (gloo, mpi; "cpu:gloo,cuda:nccl" too)
  // moves host memory. A group of nccl alone moves device memory, and only under GPipe: an NCCL
  // send may wait for its matching receive (NVIDIA/nccl#479, "send is allowed to block until the
  // corresponding recv is called"), and 1F1B has both neighbours send before they receive, so
  // over nccl alone it would hang until the timeout. GPipe's order (all activations forward, then
  // all gradients back) matches every send with a receive already posted in the same order.
  torch::Device choose_wire(torch::Device device, Schedule schedule) const {
    if (pg_->moves(torch::kCPU)) {
      return torch::kCPU;
    }
    TORCH_CHECK(device.is_cuda(), "pipeline: this stage is on ", device,
                " but the group (backend '", pg_->backend_name(),
                "') has no engine for CPU tensors; use backend 'auto' or ", "'cpu:gloo,cuda:nccl'");
    TORCH_CHECK(schedule == Schedule::kGPipe, "pipeline: the ", to_string(schedule),
                " schedule cannot run over nccl alone (an NCCL send may wait for its receive, and ",
                "1F1B's neighbours both send first); use backend 'auto' or 'cpu:gloo,cuda:nccl', ",
                "where stages exchange tensors through host memory, or the gpipe schedule");
    return device;
  }
  torch::Device wire_device() const { return wire_; }

  dist::ProcessGroupPtr pg_;
  std::vector<int> ranks_;
  torch::Device wire_;
  std::vector<std::pair<dist::WorkPtr, at::Tensor>> pending_;  // the tensor lives until sent
  std::string broken_;  // why an earlier step failed; "" while the stages are in step
};

}  // namespace

std::shared_ptr<Transport> make_thread_transport(std::chrono::milliseconds timeout) {
  return std::make_shared<ThreadTransport>(timeout);
}

std::shared_ptr<Transport> make_process_group_transport(dist::ProcessGroupPtr pg,
                                                        std::vector<int> stage_ranks,
                                                        torch::Device device,
                                                        Schedule schedule) {
  return std::make_shared<ProcessGroupTransport>(std::move(pg), std::move(stage_ranks), device,
                                                 schedule);
}

}  // namespace pipeline
}  // namespace paratrain
