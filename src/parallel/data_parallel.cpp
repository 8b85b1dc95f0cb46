#include "paratrain/parallel/data_parallel.h"

#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include "base/errors.h"
#include "paratrain/comm/devices.h"
#include "paratrain/parallel/threads.h"
#include "paratrain/util/autograd_node.h"
#include "util/copies.h"
#include "worker_team.h"

#include <algorithm>
#include <atomic>
#include <sstream>

namespace paratrain {

struct DataParallel::State {
  std::shared_ptr<torch::nn::Module> module;
  ForwardFn forward;
  std::vector<torch::Device> devices;
  torch::Device output_device{torch::kCPU};
  int64_t dim = 0;
  // replicas[0] is the module itself; the others are clones on devices[i].
  std::vector<std::shared_ptr<torch::nn::Module>> replicas;
  std::vector<std::vector<at::Tensor>> params;   // per replica, in module->parameters() order
  std::vector<std::vector<at::Tensor>> buffers;  // per replica, in module->buffers() order
  std::atomic<int> live_graphs{0};  // gathered outputs whose backward has not run or been freed
  std::unique_ptr<detail::WorkerTeam> team;
  size_t last_used = 0;
};

namespace {

using torch::autograd::variable_list;

std::string describe_replica(size_t i, const torch::Device& d) {
  std::ostringstream s;
  s << "replica " << i << " on " << d;
  return s.str();
}

// Runs tasks on the team and rethrows the first failure as one error that names the replica,
// after every thread has finished (nothing is left running on the replicas).
void run_replicas(detail::WorkerTeam& team,
                  const std::vector<std::function<void()>>& tasks,
                  const std::vector<torch::Device>& devices,
                  const char* phase) {
  std::vector<std::exception_ptr> errors = team.run(tasks);
  for (size_t i = 0; i < errors.size(); ++i) {
    if (errors[i]) {
      TORCH_CHECK(false, "DataParallel: ", describe_replica(i, devices[i]), " failed in ", phase,
                  ": ", detail::error_message(errors[i]));
    }
  }
}

// The gradient function of the gathered output (Note [How DataParallel runs replicas]). Inputs
// (next edges): the k input chunks, then the module's parameters.
struct GatherBackward : torch::autograd::Node {
  std::shared_ptr<DataParallel::State> state;
  std::vector<at::Tensor> outputs;         // each replica's output, with its graph
  std::vector<at::Tensor> replica_inputs;  // each replica's chunk (a leaf), when it needs a grad
  std::vector<torch::Device> chunk_devices;
  std::vector<int64_t> sizes;  // rows of each chunk along dim
  int64_t dim = 0;
  size_t num_params = 0;

  std::mutex mutex;  // outputs: two backwards of one retained graph may run at once

  std::string name() const override { return "paratrain::DataParallelGatherBackward"; }

  ~GatherBackward() override { release_variables(); }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex);
    if (!outputs.empty()) {
      outputs.clear();
      replica_inputs.clear();
      --state->live_graphs;
    }
  }

  variable_list apply(variable_list&& grads) override {
    const size_t k = sizes.size();
    variable_list result(k + num_params);
    std::vector<at::Tensor> outs;
    std::vector<at::Tensor> leaves;
    {
      std::lock_guard<std::mutex> lock(mutex);
      outs = outputs;
      leaves = replica_inputs;
    }
    TORCH_CHECK(!outs.empty(),
                "DataParallel: backward through an output whose graph was already freed; pass "
                "retain_graph=true to the first backward to run it twice");
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) {
      return result;
    }
    auto& st = *state;
    // Which parameters each replica is asked about: those of the module that need a gradient.
    std::vector<size_t> wanted;
    for (size_t j = 0; j < num_params; ++j) {
      if (should_compute_output(k + j)) {
        wanted.push_back(j);
      }
    }
    const Asks asks = ask_replicas(grad, leaves, wanted);
    // retain_graph: the graphs are freed with this node (release_variables), so a user's
    // backward(retain_graph=true) can run twice.
    std::vector<variable_list> replica_grads =
        std::all_of(st.devices.begin(), st.devices.end(),
                    [](const torch::Device& d) { return d.is_cpu(); })
            ? grads_on_threads(outs, asks)
            : grads_reentrant(outs, asks);
    for (size_t i = 0; i < k; ++i) {
      if (!replica_grads[i].empty() && replica_grads[i][0].defined()) {
        result[i] = replica_grads[i][0].to(chunk_devices[i]);
      }
    }
    sum_parameter_grads(replica_grads, wanted, result);
    return result;
  }

 private:
  // Per replica: its output, the gradient for it, and what it is asked about (its chunk when
  // the input needs a gradient, then the wanted parameters).
  struct Asks {
    std::vector<variable_list> inputs;
    std::vector<at::Tensor> grad_outs;
    std::vector<bool> want_input;
  };

  Asks ask_replicas(const at::Tensor& grad,
                    const std::vector<at::Tensor>& leaves,
                    const std::vector<size_t>& wanted) {
    auto& st = *state;
    const size_t k = sizes.size();
    Asks asks;
    asks.inputs.resize(k);
    asks.grad_outs.resize(k);
    asks.want_input.resize(k);
    int64_t offset = 0;
    for (size_t i = 0; i < k; ++i) {
      asks.grad_outs[i] = detail::to_device(grad.narrow(dim, offset, sizes[i]), st.devices[i]);
      offset += sizes[i];
      asks.want_input[i] = leaves[i].defined() && should_compute_output(i);
      if (asks.want_input[i]) {
        asks.inputs[i].push_back(leaves[i]);
      }
      for (size_t j : wanted) {
        asks.inputs[i].push_back(st.params[i][j]);
      }
    }
    return asks;
  }

  // A replica's gradients as sum_parameter_grads reads them: [0] is the chunk's gradient
  // (undefined when not asked), then one per wanted parameter.
  static variable_list unpack(const Asks& asks, size_t i, variable_list got) {
    if (!asks.want_input[i]) {
      got.insert(got.begin(), at::Tensor());
    }
    return got;
  }

  // CPU: the autograd engine runs a CPU graph on the calling thread, so one thread per
  // replica is what makes their backward passes parallel.
  std::vector<variable_list> grads_on_threads(const std::vector<at::Tensor>& outs,
                                              const Asks& asks) {
    const size_t k = sizes.size();
    std::vector<variable_list> replica_grads(k);
    std::vector<std::function<void()>> tasks;
    for (size_t i = 0; i < k; ++i) {
      tasks.emplace_back([&, i] {
        if (!asks.inputs[i].empty()) {
          replica_grads[i] =
              unpack(asks, i,
                     torch::autograd::grad({outs[i]}, asks.inputs[i], {asks.grad_outs[i]},
                                           /*retain_graph=*/true, /*create_graph=*/false,
                                           /*allow_unused=*/true));
        }
      });
    }
    run_replicas(*state->team, tasks, state->devices, "backward");
    return replica_grads;
  }

  // Accelerators: this node runs on the engine's thread for output_device, which a replica's
  // graph also needs, so waiting here for other threads would deadlock. One reentrant grad()
  // over all replicas instead: the engine spreads it over its per-device threads.
  std::vector<variable_list> grads_reentrant(const std::vector<at::Tensor>& outs,
                                             const Asks& asks) {
    const size_t k = sizes.size();
    std::vector<variable_list> replica_grads(k);
    variable_list all_outs;
    variable_list all_grads;
    variable_list all_inputs;
    for (size_t i = 0; i < k; ++i) {
      if (!asks.inputs[i].empty()) {
        all_outs.push_back(outs[i]);
        all_grads.push_back(asks.grad_outs[i]);
        all_inputs.insert(all_inputs.end(), asks.inputs[i].begin(), asks.inputs[i].end());
      }
    }
    variable_list got =
        torch::autograd::grad(all_outs, all_inputs, all_grads, /*retain_graph=*/true,
                              /*create_graph=*/false, /*allow_unused=*/true);
    size_t next = 0;
    for (size_t i = 0; i < k; ++i) {
      if (!asks.inputs[i].empty()) {
        variable_list mine(got.begin() + static_cast<std::ptrdiff_t>(next),
                           got.begin() + static_cast<std::ptrdiff_t>(next + asks.inputs[i].size()));
        next += asks.inputs[i].size();
        replica_grads[i] = unpack(asks, i, std::move(mine));
      }
    }
    return replica_grads;
  }

  // Sum each parameter's gradients on the module's device, replica 0's first (it is already
  // there), in replica order, so the result does not depend on thread timing.
  void sum_parameter_grads(const std::vector<variable_list>& replica_grads,
                           const std::vector<size_t>& wanted,
                           variable_list& result) const {
    const size_t k = sizes.size();
    for (size_t w = 0; w < wanted.size(); ++w) {
      at::Tensor sum;
      for (size_t i = 0; i < k; ++i) {
        if (replica_grads[i].empty()) {
          continue;
        }
        const at::Tensor& g = replica_grads[i][w + 1];
        if (!g.defined()) {
          continue;
        }
        at::Tensor here = g.to(state->devices[0]);
        if (sum.defined()) {
          sum.add_(here);
        } else {
          sum = here.clone();  // grad() may hand back the incoming gradient itself
        }
      }
      result[k + wanted[w]] = sum;
    }
  }
};

// Refresh the clones (Note [How DataParallel runs replicas]). An in-place copy into a clone
// whose graph from an earlier forward still waits for backward invalidates that graph (autograd
// then refuses its backward), so while such graphs live, parameters are copied only when their
// values differ (libtorch's optimizers update parameters without bumping version counters, so
// versions cannot tell), and buffers only in eval mode, the one mode that reads them (BatchNorm
// saves its running statistics for backward even in training).
void refresh_replicas(DataParallel::State& st, size_t k) {
  torch::NoGradGuard no_grad;
  const auto& mine = st.params[0];
  const bool graphs_live = st.live_graphs.load() > 0;
  const bool training = st.module->is_training();
  for (size_t i = 1; i < k; ++i) {
    bool copy = !graphs_live;
    for (size_t j = 0; !copy && j < mine.size(); ++j) {
      copy = !torch::equal(st.params[i][j], mine[j].to(st.devices[i]));
    }
    if (copy) {
      for (size_t j = 0; j < mine.size(); ++j) {
        detail::copy_to(st.params[i][j], mine[j]);
      }
    }
    if (!graphs_live || !training) {
      for (size_t j = 0; j < st.buffers[0].size(); ++j) {
        detail::copy_to(st.buffers[i][j], st.buffers[0][j]);
      }
    }
    st.replicas[i]->train(training);
  }
}

// Runs each replica on its chunk, one thread each; fills replica_inputs and outputs.
void forward_replicas(DataParallel::State& st,
                      const std::vector<at::Tensor>& chunks,
                      bool grad_mode,
                      std::vector<at::Tensor>& replica_inputs,
                      std::vector<at::Tensor>& outputs) {
  std::vector<std::function<void()>> tasks;
  for (size_t i = 0; i < chunks.size(); ++i) {
    tasks.emplace_back([&, i] {
      c10::DeviceGuard guard(st.devices[i]);
      // Each replica works on a leaf of its own: its graph ends here, and GatherBackward routes
      // the chunk's gradient back to the caller's input.
      at::Tensor x = detail::to_device(chunks[i], st.devices[i]).detach();
      if (grad_mode && chunks[i].requires_grad()) {
        x.requires_grad_(true);
      }
      replica_inputs[i] = x;
      outputs[i] = st.forward(*st.replicas[i], x);
      TORCH_CHECK(outputs[i].defined() && outputs[i].dim() > st.dim,
                  "the module returned a tensor that cannot be gathered along dim ", st.dim);
    });
  }
  run_replicas(*st.team, tasks, st.devices, "forward");
}

// Makes a GatherBackward the gradient function of `gathered`.
void attach_gather_backward(const std::shared_ptr<DataParallel::State>& state,
                            const std::vector<at::Tensor>& chunks,
                            const std::vector<at::Tensor>& replica_inputs,
                            const std::vector<at::Tensor>& outputs,
                            at::Tensor& gathered) {
  DataParallel::State& st = *state;
  auto node = autograd_graph::make_node<GatherBackward>();
  node->state = state;
  node->outputs = outputs;
  node->dim = st.dim;
  node->num_params = st.params[0].size();
  for (size_t i = 0; i < chunks.size(); ++i) {
    node->sizes.push_back(chunks[i].size(st.dim));
    node->chunk_devices.push_back(chunks[i].device());
    node->replica_inputs.push_back(replica_inputs[i].requires_grad() ? replica_inputs[i]
                                                                     : at::Tensor());
  }
  variable_list edges_of(chunks.begin(), chunks.end());
  edges_of.insert(edges_of.end(), st.params[0].begin(), st.params[0].end());
  node->set_next_edges(torch::autograd::collect_next_edges(edges_of));
  torch::autograd::set_history(gathered, node);
  ++st.live_graphs;  // the node's release_variables (or destructor) takes it back
}

}  // namespace

DataParallel::DataParallel(std::shared_ptr<torch::nn::Module> module,
                           ForwardFn forward,
                           std::vector<torch::Device> devices,
                           DataParallelOptions options)
    : state_(std::make_shared<State>()) {
  TORCH_CHECK(module != nullptr, "DataParallel: the module is null");
  TORCH_CHECK(!devices.empty(),
              "DataParallel: the device list is empty; name at least one device, e.g. "
              "{torch::kCPU, torch::kCPU} or {cuda:0, cuda:1}");
  for (const auto& d : devices) {
    check_device_exists(d);
  }
  State& st = *state_;
  st.module = std::move(module);
  st.forward = std::move(forward);
  st.devices = std::move(devices);
  st.output_device = options.output_device().value_or(st.devices[0]);
  check_device_exists(st.output_device);
  st.dim = options.dim();
  TORCH_CHECK(st.dim >= 0, "DataParallel: dim must be >= 0, got ", st.dim);

  const torch::Device home = st.devices[0];
  auto check_home = [&](const std::string& name, const at::Tensor& t) {
    TORCH_CHECK(t.device() == home ||
                    (home.is_cpu() && t.device().is_cpu()),  // cpu and cpu:0 are one device
                "DataParallel: the module must have its parameters and buffers on devices[0] (",
                home, "), but ", name, " is on ", t.device(), "; call module->to(", home,
                ") first");
  };
  for (const auto& p : st.module->named_parameters()) {
    check_home(p.key(), p.value());
  }
  for (const auto& b : st.module->named_buffers()) {
    check_home(b.key(), b.value());
  }

  st.replicas.push_back(st.module);
  for (size_t i = 1; i < st.devices.size(); ++i) {
    try {
      st.replicas.push_back(st.module->clone(st.devices[i]));
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "DataParallel: cannot clone the module for ", st.devices[i], ": ",
                  e.what_without_backtrace(),
                  " (derive the module from torch::nn::Cloneable<YourImpl> and implement "
                  "reset())");
    }
  }
  for (const auto& r : st.replicas) {
    st.params.push_back(r->parameters());
    st.buffers.push_back(r->buffers());
  }

  size_t cpu_replicas = 0;
  for (const auto& d : st.devices) {
    cpu_replicas += d.is_cpu() ? 1 : 0;
  }
  int threads = options.threads_per_replica();
  TORCH_CHECK(threads >= 0, "DataParallel: threads_per_replica must be >= 0, got ", threads);
  if (threads == 0) {
    threads = std::max<int>(
        1, at::get_num_threads() / static_cast<int>(std::max<size_t>(1, cpu_replicas)));
  }
  if (st.devices.size() > 1) {
    const bool uses_cuda = std::any_of(st.devices.begin(), st.devices.end(),
                                       [](const torch::Device& d) { return d.is_cuda(); });
    st.team = std::make_unique<detail::WorkerTeam>(st.devices.size(), threads, uses_cuda);
    if (cpu_replicas > 1) {
      set_blas_threads(threads);
    }
  }
}

DataParallel::~DataParallel() = default;
DataParallel::DataParallel(DataParallel&&) noexcept = default;
DataParallel& DataParallel::operator=(DataParallel&&) noexcept = default;

const std::shared_ptr<torch::nn::Module>& DataParallel::module() const {
  return state_->module;
}
const std::vector<torch::Device>& DataParallel::devices() const {
  return state_->devices;
}
torch::Device DataParallel::output_device() const {
  return state_->output_device;
}
size_t DataParallel::last_replicas_used() const {
  return state_->last_used;
}

torch::Tensor DataParallel::forward(const torch::Tensor& input) {
  State& st = *state_;
  TORCH_CHECK(input.defined(), "DataParallel: the input is an undefined tensor");
  TORCH_CHECK(input.dim() > st.dim, "DataParallel: cannot split a ", input.dim(),
              "-d input of shape ", input.sizes(), " along dim ", st.dim);
  const int64_t batch = input.size(st.dim);
  TORCH_CHECK(batch > 0, "DataParallel: the input has no samples along dim ", st.dim, " (shape ",
              input.sizes(), ")");
  if (st.devices.size() == 1) {  // as PyTorch: the module alone, output stays on devices[0]
    st.last_used = 1;
    return st.forward(*st.module, input.to(st.devices[0]));
  }

  std::vector<at::Tensor> chunks = input.chunk(static_cast<int64_t>(st.devices.size()), st.dim);
  const size_t k = chunks.size();
  st.last_used = k;
  refresh_replicas(st, k);

  const bool grad_mode = torch::GradMode::is_enabled();
  std::vector<at::Tensor> replica_inputs(k);
  std::vector<at::Tensor> outputs(k);
  forward_replicas(st, chunks, grad_mode, replica_inputs, outputs);

  std::vector<at::Tensor> detached;
  for (const auto& o : outputs) {
    detached.push_back(o.detach().to(st.output_device));
  }
  at::Tensor gathered = torch::cat(detached, st.dim);

  bool needs_grad = false;
  for (const auto& o : outputs) {
    needs_grad = needs_grad || o.requires_grad();
  }
  if (!grad_mode || !needs_grad || !torch::autograd::isDifferentiableType(gathered.scalar_type())) {
    return gathered;
  }
  attach_gather_backward(state_, chunks, replica_inputs, outputs, gathered);
  return gathered;
}

}  // namespace paratrain
