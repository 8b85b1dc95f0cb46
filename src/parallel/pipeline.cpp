#include "paratrain/parallel/pipeline.h"

#include <c10/core/DeviceGuard.h>
#include <torch/autograd.h>
#include <torch/torch.h>

#include "../util/copies.h"
#include "../util/errors.h"
#include "paratrain/dist/devices.h"
#include "paratrain/parallel/threads.h"
#include "worker_team.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <sstream>
#include <tuple>

namespace paratrain {
namespace pipeline {

namespace nn = torch::nn;
using Clock = std::chrono::steady_clock;

// ---- splitting ------------------------------------------------------------------------------

nn::Sequential as_sequential(const std::shared_ptr<nn::Module>& module) {
  TORCH_CHECK(module != nullptr, "pipeline: the module is null");
  auto seq = std::dynamic_pointer_cast<nn::SequentialImpl>(module);
  TORCH_CHECK(seq != nullptr, "pipeline: a pipeline needs a torch::nn::Sequential, got ",
              module->name(),
              "; write the model as a Sequential of its layers (as the ModelParallelResNet50 of "
              "PyTorch's model-parallel tutorial is conv1..layer2 then layer3..fc), so it can be "
              "cut between layers");
  return nn::Sequential(seq);
}

std::vector<nn::Sequential> split(const nn::Sequential& model,
                                  const std::vector<int64_t>& balance) {
  const int64_t layers = static_cast<int64_t>(model->size());
  TORCH_CHECK(!balance.empty(), "pipeline: the balance is empty; give one layer count per stage");
  TORCH_CHECK(static_cast<int64_t>(balance.size()) <= layers, "pipeline: ", balance.size(),
              " stages but the model has only ", layers, " layers; use at most ", layers,
              " stages");
  int64_t sum = 0;
  for (size_t i = 0; i < balance.size(); ++i) {
    TORCH_CHECK(balance[i] >= 1, "pipeline: stage ", i, " of the balance has ", balance[i],
                " layers; every stage needs at least one");
    sum += balance[i];
  }
  TORCH_CHECK(sum == layers, "pipeline: the balance ", c10::IntArrayRef(balance), " sums to ", sum,
              " layers but the model has ", layers);
  auto names = model->named_children();
  std::vector<nn::Sequential> stages;
  int64_t next = 0;
  for (int64_t count : balance) {
    nn::Sequential stage;
    for (int64_t j = 0; j < count; ++j, ++next) {
      // AnyModule copies share the layer: the stage trains the model's own parameters.
      stage->push_back(names[static_cast<size_t>(next)].key(),
                       *(model->begin() + static_cast<std::ptrdiff_t>(next)));
    }
    stages.push_back(stage);
  }
  return stages;
}

nn::Sequential flatten(const nn::Sequential& model) {
  nn::Sequential flat;
  auto names = model->named_children();
  size_t i = 0;
  for (auto it = model->begin(); it != model->end(); ++it, ++i) {
    auto inner = std::dynamic_pointer_cast<nn::SequentialImpl>(it->ptr());
    if (inner == nullptr) {
      flat->push_back(names[i].key(), *it);
      continue;
    }
    auto inner_names = inner->named_children();
    size_t j = 0;
    for (auto jt = inner->begin(); jt != inner->end(); ++jt, ++j) {
      flat->push_back(names[i].key() + "_" + inner_names[j].key(), *jt);
    }
  }
  return flat;
}

std::vector<int64_t> partition(const std::vector<double>& costs, int64_t parts) {
  const int64_t n = static_cast<int64_t>(costs.size());
  TORCH_CHECK(parts >= 1, "pipeline: need at least one stage, got ", parts);
  TORCH_CHECK(parts <= n, "pipeline: ", parts, " stages but the model has only ", n,
              " layers; use at most ", n, " stages");
  std::vector<double> prefix(static_cast<size_t>(n + 1), 0);
  for (int64_t i = 0; i < n; ++i) {
    prefix[static_cast<size_t>(i + 1)] =
        prefix[static_cast<size_t>(i)] + costs[static_cast<size_t>(i)];
  }
  // best[k][i]: the smallest largest-part cost of the first i layers in k parts; the classic
  // linear-partition dynamic programme (n is a few dozen layers at most).
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(static_cast<size_t>(parts + 1),
                                        std::vector<double>(static_cast<size_t>(n + 1), inf));
  std::vector<std::vector<int64_t>> cut(static_cast<size_t>(parts + 1),
                                        std::vector<int64_t>(static_cast<size_t>(n + 1), 0));
  best[0][0] = 0;
  for (int64_t k = 1; k <= parts; ++k) {
    for (int64_t i = k; i <= n; ++i) {
      for (int64_t j = k - 1; j < i; ++j) {
        const double cost =
            std::max(best[static_cast<size_t>(k - 1)][static_cast<size_t>(j)],
                     prefix[static_cast<size_t>(i)] - prefix[static_cast<size_t>(j)]);
        // Ties go to the later cut, which leaves the earlier stages no heavier.
        if (cost <= best[static_cast<size_t>(k)][static_cast<size_t>(i)]) {
          best[static_cast<size_t>(k)][static_cast<size_t>(i)] = cost;
          cut[static_cast<size_t>(k)][static_cast<size_t>(i)] = j;
        }
      }
    }
  }
  std::vector<int64_t> balance(static_cast<size_t>(parts));
  int64_t end = n;
  for (int64_t k = parts; k >= 1; --k) {
    const int64_t begin = cut[static_cast<size_t>(k)][static_cast<size_t>(end)];
    balance[static_cast<size_t>(k - 1)] = end - begin;
    end = begin;
  }
  return balance;
}

std::vector<int64_t> balance_by_parameters(const nn::Sequential& model, int64_t stages) {
  std::vector<double> costs;
  for (const auto& child : model->children()) {
    double n = 0;
    for (const auto& p : child->parameters()) {
      n += static_cast<double>(p.numel());
    }
    costs.push_back(n);
  }
  return partition(costs, stages);
}

std::vector<int64_t> balance_by_time(const nn::Sequential& model,
                                     int64_t stages,
                                     const torch::Tensor& sample,
                                     int repeats) {
  TORCH_CHECK(repeats >= 1, "pipeline: balance_by_time needs repeats >= 1, got ", repeats);
  // Timing runs real forwards and backwards: keep the model's gradients and buffers as they were.
  std::vector<at::Tensor> grads;
  for (const auto& p : model->parameters()) {
    grads.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
  }
  std::vector<at::Tensor> buffers;
  for (const auto& b : model->buffers()) {
    buffers.push_back(b.clone());
  }
  std::vector<double> costs;
  at::Tensor x = sample;
  nn::Sequential layers = model;  // non-const: AnyModule::forward is not const
  for (auto it = layers->begin(); it != layers->end(); ++it) {
    double fastest = std::numeric_limits<double>::infinity();
    at::Tensor y;
    for (int r = 0; r < repeats; ++r) {
      at::Tensor in = x.detach();
      if (in.is_floating_point()) {
        in.requires_grad_(true);
      }
      auto t0 = Clock::now();
      y = it->forward(in);
      if (y.requires_grad()) {
        y.backward(torch::ones_like(y));
      }
      fastest = std::min(fastest, std::chrono::duration<double>(Clock::now() - t0).count());
    }
    costs.push_back(fastest);
    x = y.detach();
  }
  torch::NoGradGuard no_grad;
  auto params = model->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].mutable_grad() = grads[i];
  }
  auto now = model->buffers();
  for (size_t i = 0; i < now.size(); ++i) {
    now[i].copy_(buffers[i]);
  }
  return partition(costs, stages);
}

// ---- schedules ------------------------------------------------------------------------------

Schedule parse_schedule(const std::string& name) {
  std::string lower;
  for (char c : name) {
    lower.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  }
  if (lower == "gpipe") {
    return Schedule::kGPipe;
  }
  if (lower == "1f1b") {
    return Schedule::k1F1B;
  }
  TORCH_CHECK(false, "pipeline: unknown schedule '", name, "': choose gpipe or 1f1b");
}

std::string to_string(Schedule schedule) {
  return schedule == Schedule::kGPipe ? "gpipe" : "1f1b";
}

std::vector<Action> actions(Schedule schedule, int64_t stage, int64_t stages, int64_t chunks) {
  TORCH_CHECK(stages >= 1 && stage >= 0 && stage < stages, "pipeline: stage ", stage, " of ",
              stages, " does not exist");
  TORCH_CHECK(chunks >= 1, "pipeline: chunks must be >= 1, got ", chunks);
  using K = Action::Kind;
  std::vector<Action> out;
  if (schedule == Schedule::kGPipe) {
    for (int64_t i = 0; i < chunks; ++i) {
      out.push_back({K::kForward, i});
    }
    for (int64_t i = 0; i < chunks; ++i) {
      out.push_back({K::kBackward, i});
    }
    return out;
  }
  // 1F1B (PipeDream-Flush): the later the stage, the fewer forwards run ahead of the first
  // backward, which bounds the activations held on stage s by p - s.
  const int64_t warmup = std::min(stages - stage - 1, chunks);
  int64_t f = 0;
  int64_t b = 0;
  for (; f < warmup; ++f) {
    out.push_back({K::kForward, f});
  }
  while (f < chunks) {
    out.push_back({K::kForward, f++});
    out.push_back({K::kBackward, b++});
  }
  while (b < chunks) {
    out.push_back({K::kBackward, b++});
  }
  return out;
}

// ---- transports -----------------------------------------------------------------------------

namespace {

// Thrown in a stage woken because another stage failed: the other stage's error is the one to
// report.
struct StageAborted : std::runtime_error {
  using std::runtime_error::runtime_error;
};

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
      throw StageAborted(aborted_);
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

// ---- one stage's work -----------------------------------------------------------------------

// Named, not anonymous: Pipeline::Impl and DistributedPipeline::Impl hold these, and a unity
// build would otherwise warn that they use types of internal linkage.
namespace stage_work {

// Runs one stage's actions over a transport; shared by Pipeline (one per thread) and
// DistributedPipeline (one per rank).
struct StageRunner {
  nn::Sequential module{nullptr};
  torch::Device device{torch::kCPU};
  int64_t index = 0;
  int64_t count = 1;
  LossFn loss;
  PipelineOptions options;
  DistributedDataParallel* ddp = nullptr;
  Transport* transport = nullptr;

  // Per step.
  std::vector<at::Tensor> inputs;   // first stage: the micro-batches
  std::vector<at::Tensor> targets;  // last stage
  int64_t batch = 0;                // last stage: samples in the whole batch
  at::Tensor loss_sum;              // last stage
  std::vector<at::Tensor> outputs;  // last stage, forward-only runs
  StageStats stats;

  struct Saved {
    at::Tensor input;   // this stage's input leaf (its .grad goes to the previous stage)
    at::Tensor output;  // with its graph (not with checkpoint)
    at::Tensor loss;    // last stage
  };
  std::map<int64_t, Saved> saved;
  double waiting = 0;

  bool is_last() const { return index == count - 1; }

  // Drops what a failed step left (graphs of saved micro-batches hold memory).
  void clear() {
    saved.clear();
    inputs.clear();
    targets.clear();
    outputs.clear();
  }

  at::Tensor run_module(const at::Tensor& x) {
    return ddp != nullptr ? ddp->forward(x) : module->forward(x);
  }

  at::Tensor receive(int64_t from, int64_t mb, bool grad) {
    auto t0 = Clock::now();
    at::Tensor t = transport->recv(from, index, mb, grad);
    waiting += std::chrono::duration<double>(Clock::now() - t0).count();
    return detail::to_device(t, device);
  }

  at::Tensor compute_loss(const at::Tensor& out, int64_t mb) {
    const at::Tensor& target = targets[static_cast<size_t>(mb)];
    at::Tensor l = loss(out, detail::to_device(target, device));
    TORCH_CHECK(l.numel() == 1, "the loss function returned a tensor of shape ", l.sizes(),
                "; it must return a scalar (reduce with mean or sum)");
    if (options.scale_loss()) {
      l = l * (static_cast<double>(target.size(0)) / static_cast<double>(batch));
    }
    return l;
  }

  void forward(int64_t mb, bool training) {
    at::Tensor x = index == 0 ? detail::to_device(inputs[static_cast<size_t>(mb)], device)
                              : receive(index - 1, mb, /*grad=*/false);
    Saved s;
    s.input = x.detach();
    if (index > 0 && training && s.input.is_floating_point()) {
      s.input.requires_grad_(true);
    }
    at::Tensor out;
    {
      // Without a graph: evaluation, or recomputation's first pass.
      torch::AutoGradMode mode(training && !options.checkpoint());
      out = run_module(s.input);
      if (is_last()) {
        if (training) {
          at::Tensor l = compute_loss(out, mb);
          loss_sum = loss_sum.defined() ? loss_sum + l.detach() : l.detach();
          s.loss = l;
        } else {
          outputs.push_back(out);
        }
      }
    }
    if (!is_last()) {
      transport->send(index, index + 1, mb, /*grad=*/false, out.detach());
      s.output = out;
    }
    if (training) {
      if (options.checkpoint()) {
        s.output = at::Tensor();
        s.loss = at::Tensor();
      }
      saved[mb] = std::move(s);
      stats.max_live_micro_batches =
          std::max<int64_t>(stats.max_live_micro_batches, static_cast<int64_t>(saved.size()));
    }
  }

  void backward(int64_t mb,
                bool last_backward,
                std::optional<DistributedDataParallel::NoSyncGuard>& no_sync) {
    auto it = saved.find(mb);
    TORCH_CHECK(it != saved.end(), "pipeline: stage ", index, " has no forward of micro-batch ", mb,
                " to run backward on");
    Saved s = std::move(it->second);
    saved.erase(it);
    if (options.checkpoint()) {  // re-materialise this stage's graph
      s.output = run_module(s.input);
      if (is_last()) {
        s.loss = compute_loss(s.output, mb);
      }
    }
    const at::Tensor& root = is_last() ? s.loss : s.output;
    if (last_backward && ddp != nullptr) {
      // The other backwards accumulated locally; this one reduces everything (Note in the
      // header of DistributedPipeline).
      no_sync.reset();
      ddp->prepare_for_backward(root);
    }
    if (is_last()) {
      if (root.requires_grad()) {
        root.backward();
      }
    } else {
      at::Tensor g = receive(index + 1, mb, /*grad=*/true);
      if (root.requires_grad()) {
        torch::autograd::backward({root}, {g});
      }
    }
    if (index > 0) {
      at::Tensor gi = s.input.grad();
      transport->send(index, index - 1, mb, /*grad=*/true,
                      gi.defined() ? gi : torch::zeros_like(s.input));
    }
  }

  void run(const std::vector<Action>& acts, bool training) {
    c10::DeviceGuard guard(device);
    stats = StageStats();
    saved.clear();
    outputs.clear();
    loss_sum = at::Tensor();
    waiting = 0;
    std::optional<DistributedDataParallel::NoSyncGuard> no_sync;
    if (ddp != nullptr && training) {
      no_sync.emplace(*ddp);
    }
    torch::AutoGradMode mode(training);
    auto t0 = Clock::now();
    for (size_t i = 0; i < acts.size(); ++i) {
      if (acts[i].kind == Action::Kind::kForward) {
        forward(acts[i].micro_batch, training);
      } else {
        backward(acts[i].micro_batch, i + 1 == acts.size(), no_sync);
      }
    }
    stats.busy_seconds = std::chrono::duration<double>(Clock::now() - t0).count() - waiting;
  }
};

void check_chunks(int64_t chunks, int64_t batch, const char* what) {
  TORCH_CHECK(chunks >= 1, "pipeline: chunks must be >= 1, got ", chunks);
  TORCH_CHECK(chunks <= batch, "pipeline: chunks (", chunks, ") is larger than the batch (", batch,
              " samples in the ", what, "); use at most ", batch, " chunks");
}

std::vector<at::Tensor> micro_batches(const at::Tensor& t, int64_t chunks, const char* what) {
  TORCH_CHECK(t.defined() && t.dim() >= 1, "pipeline: the ", what,
              " must be a tensor with a batch dimension");
  check_chunks(chunks, t.size(0), what);
  return torch::tensor_split(t, chunks, 0);
}

std::vector<Action> forwards_only(int64_t chunks) {
  std::vector<Action> out;
  for (int64_t i = 0; i < chunks; ++i) {
    out.push_back({Action::Kind::kForward, i});
  }
  return out;
}

}  // namespace stage_work

using namespace stage_work;  // NOLINT: this file's own helpers

// ---- Pipeline -------------------------------------------------------------------------------

struct Pipeline::Impl {
  std::vector<nn::Sequential> stages;
  std::vector<torch::Device> devices;
  PipelineOptions options;
  std::vector<StageRunner> runners;
  std::unique_ptr<detail::WorkerTeam> team;
  double last_step_seconds = 0;

  // Runs every stage's actions on its thread; reports the first real failure by stage.
  void run_all(const std::function<std::vector<Action>(int64_t)>& acts, bool training) {
    auto transport = make_thread_transport(options.timeout());
    std::vector<std::function<void()>> tasks;
    for (size_t i = 0; i < runners.size(); ++i) {
      runners[i].transport = transport.get();
      tasks.emplace_back([&, i] {
        try {
          runners[i].run(acts(static_cast<int64_t>(i)), training);
        } catch (const StageAborted&) {
          throw;
        } catch (...) {
          transport->abort("stage " + std::to_string(i) + " failed");
          throw;
        }
      });
    }
    auto errors = team->run(tasks);
    if (std::any_of(errors.begin(), errors.end(), [](const auto& e) { return e != nullptr; })) {
      for (auto& r : runners) {
        r.clear();
      }
    }
    for (size_t i = 0; i < errors.size(); ++i) {
      if (!errors[i]) {
        continue;
      }
      try {
        std::rethrow_exception(errors[i]);
      } catch (const StageAborted&) {
        continue;
      } catch (...) {
      }
      TORCH_CHECK(false, "pipeline: stage ", i, " on ", devices[i],
                  " failed: ", detail::error_message(errors[i]));
    }
  }
};

Pipeline::Pipeline(nn::Sequential model,
                   std::vector<int64_t> balance,
                   std::vector<torch::Device> devices,
                   LossFn loss,
                   PipelineOptions options)
    : impl_(std::make_unique<Impl>()) {
  TORCH_CHECK(options.chunks() >= 1, "pipeline: chunks must be >= 1, got ", options.chunks());
  TORCH_CHECK(!devices.empty(), "pipeline: the device list is empty; give one device per stage");
  impl_->stages = split(model, balance);
  TORCH_CHECK(devices.size() == impl_->stages.size(), "pipeline: ", impl_->stages.size(),
              " stages but ", devices.size(), " devices; give one device per stage");
  for (const auto& d : devices) {
    check_device_exists(d);
  }
  TORCH_CHECK(loss != nullptr, "pipeline: the loss function is empty");
  impl_->devices = std::move(devices);
  impl_->options = options;
  const int64_t p = static_cast<int64_t>(impl_->stages.size());
  size_t cpu_stages = 0;
  for (int64_t i = 0; i < p; ++i) {
    impl_->stages[static_cast<size_t>(i)]->to(impl_->devices[static_cast<size_t>(i)]);
    cpu_stages += impl_->devices[static_cast<size_t>(i)].is_cpu() ? 1 : 0;
    StageRunner r;
    r.module = impl_->stages[static_cast<size_t>(i)];
    r.device = impl_->devices[static_cast<size_t>(i)];
    r.index = i;
    r.count = p;
    r.loss = loss;
    r.options = options;
    impl_->runners.push_back(std::move(r));
  }
  const int threads =
      std::max<int>(1, at::get_num_threads() / static_cast<int>(std::max<size_t>(1, cpu_stages)));
  const bool uses_cuda = std::any_of(impl_->devices.begin(), impl_->devices.end(),
                                     [](const torch::Device& d) { return d.is_cuda(); });
  impl_->team = std::make_unique<detail::WorkerTeam>(static_cast<size_t>(p), threads, uses_cuda);
  if (cpu_stages > 1) {
    set_blas_threads(threads);
  }
}

Pipeline::~Pipeline() = default;

torch::Tensor Pipeline::step(const torch::Tensor& input, const torch::Tensor& target) {
  auto& im = *impl_;
  const int64_t m = im.options.chunks();
  auto& first = im.runners.front();
  auto& last = im.runners.back();
  // Checked before any runner holds them: a refused step leaves no tensor of the caller's behind.
  auto inputs = micro_batches(input, m, "input");
  auto targets = micro_batches(target, m, "target");
  TORCH_CHECK(input.size(0) == target.size(0), "pipeline: the input has ", input.size(0),
              " samples but the target ", target.size(0));
  first.inputs = std::move(inputs);
  last.targets = std::move(targets);
  last.batch = target.size(0);
  const Schedule schedule = im.options.schedule();
  const int64_t p = static_cast<int64_t>(im.runners.size());
  auto t0 = Clock::now();
  im.run_all([&](int64_t s) { return actions(schedule, s, p, m); }, /*training=*/true);
  im.last_step_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  first.inputs.clear();
  last.targets.clear();
  return last.loss_sum;
}

torch::Tensor Pipeline::forward(const torch::Tensor& input) {
  auto& im = *impl_;
  TORCH_CHECK(input.defined() && input.dim() >= 1,
              "pipeline: the input must be a tensor with a batch dimension");
  const int64_t m = std::min<int64_t>(im.options.chunks(), input.size(0));
  auto& first = im.runners.front();
  auto& last = im.runners.back();
  first.inputs = micro_batches(input, m, "input");
  im.run_all([&](int64_t) { return forwards_only(m); }, /*training=*/false);
  first.inputs.clear();
  at::Tensor out = torch::cat(last.outputs, 0);
  last.outputs.clear();
  return out;
}

const std::vector<nn::Sequential>& Pipeline::stages() const {
  return impl_->stages;
}
const std::vector<torch::Device>& Pipeline::devices() const {
  return impl_->devices;
}
const PipelineOptions& Pipeline::options() const {
  return impl_->options;
}
std::vector<StageStats> Pipeline::last_stats() const {
  std::vector<StageStats> out;
  for (const auto& r : impl_->runners) {
    out.push_back(r.stats);
  }
  return out;
}
double Pipeline::last_step_seconds() const {
  return impl_->last_step_seconds;
}

// ---- DistributedPipeline --------------------------------------------------------------------

struct DistributedPipeline::Impl {
  StageRunner runner;
  std::shared_ptr<Transport> transport;
  std::unique_ptr<DistributedDataParallel> ddp;
};

DistributedPipeline::DistributedPipeline(nn::Sequential stage_module,
                                         int64_t stage,
                                         dist::ProcessGroupPtr pg,
                                         std::vector<int> stage_ranks,
                                         torch::Device device,
                                         LossFn loss,
                                         PipelineOptions options,
                                         dist::ProcessGroupPtr data_parallel_group,
                                         DDPOptions ddp_options)
    : impl_(std::make_unique<Impl>()) {
  TORCH_CHECK(pg != nullptr, "pipeline: the process group is null");
  TORCH_CHECK(!stage_ranks.empty(), "pipeline: stage_ranks is empty; give the rank of each stage");
  const int64_t p = static_cast<int64_t>(stage_ranks.size());
  TORCH_CHECK(stage >= 0 && stage < p, "pipeline: stage ", stage,
              " does not exist in a pipeline of ", p, " stages");
  TORCH_CHECK(stage_ranks[static_cast<size_t>(stage)] == pg->rank(), "pipeline: stage ", stage,
              " belongs on rank ", stage_ranks[static_cast<size_t>(stage)], " but this is rank ",
              pg->rank());
  TORCH_CHECK(options.chunks() >= 1, "pipeline: chunks must be >= 1, got ", options.chunks());
  check_device_exists(device);
  TORCH_CHECK(stage + 1 < p || loss != nullptr, "pipeline: the last stage needs a loss function");
  // The transport first: it refuses a schedule or device the group cannot carry, and a refused
  // constructor must leave the caller's module where it was.
  impl_->transport = make_process_group_transport(pg, stage_ranks, device, options.schedule());
  stage_module->to(device);
  auto& r = impl_->runner;
  r.module = stage_module;
  r.device = device;
  r.index = stage;
  r.count = p;
  r.loss = std::move(loss);
  r.options = options;
  r.transport = impl_->transport.get();
  if (data_parallel_group != nullptr) {
    impl_->ddp =
        std::make_unique<DistributedDataParallel>(stage_module, data_parallel_group, ddp_options);
    r.ddp = impl_->ddp.get();
  }
}

DistributedPipeline::~DistributedPipeline() = default;

torch::Tensor DistributedPipeline::step(const torch::Tensor& input, const torch::Tensor& target) {
  auto& r = impl_->runner;
  const int64_t m = r.options.chunks();
  // Bad input is refused before any message moves: the pipeline stays usable.
  std::vector<at::Tensor> inputs;
  std::vector<at::Tensor> targets;
  if (r.index == 0) {
    inputs = micro_batches(input, m, "input");
  }
  if (r.is_last()) {
    targets = micro_batches(target, m, "target");
  }
  try {
    r.inputs = std::move(inputs);
    r.targets = std::move(targets);
    if (r.is_last()) {
      r.batch = target.size(0);
    }
    r.run(actions(r.options.schedule(), r.index, r.count, m), /*training=*/true);
    impl_->transport->flush();
  } catch (const std::exception& e) {
    const std::string what = e.what();
    impl_->transport->abort(what.substr(0, what.find('\n')));
    r.clear();
    throw;
  } catch (...) {
    impl_->transport->abort("an unknown exception");
    r.clear();
    throw;
  }
  r.inputs.clear();
  r.targets.clear();
  return r.is_last() ? r.loss_sum : at::Tensor();
}

bool DistributedPipeline::is_first() const {
  return impl_->runner.index == 0;
}
bool DistributedPipeline::is_last() const {
  return impl_->runner.is_last();
}
const nn::Sequential& DistributedPipeline::module() const {
  return impl_->runner.module;
}
StageStats DistributedPipeline::last_stats() const {
  return impl_->runner.stats;
}

}  // namespace pipeline
}  // namespace paratrain
