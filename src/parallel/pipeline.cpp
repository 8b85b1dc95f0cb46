// Pipeline runners: Pipeline (every stage in this process, one thread each, over a
// ThreadTransport) and DistributedPipeline (this rank's stage, over a ProcessGroupTransport),
// with the splitting of a batch into micro-batches. Partitioning is in pipeline_partition.cpp,
// schedules in pipeline_schedule.cpp, transports in pipeline_transport.cpp and one stage's work in
// pipeline_stage.cpp.

#include "pipeline_internal.h"

#include <torch/torch.h>

#include "base/errors.h"
#include "paratrain/comm/devices.h"
#include "paratrain/parallel/threads.h"
#include "worker_team.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace paratrain {
namespace pipeline {

namespace stage_work {

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
        } catch (const internal::StageAborted&) {
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
      } catch (const internal::StageAborted&) {
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

  // Runs this stage's actions; on a failure the neighbours waiting on it are woken with its
  // reason, and what the step kept is dropped.
  void run(const std::vector<Action>& acts, bool training) {
    try {
      runner.run(acts, training);
      transport->flush();
    } catch (const std::exception& e) {
      const std::string what = e.what();
      transport->abort(what.substr(0, what.find('\n')));
      runner.clear();
      throw;
    } catch (...) {
      transport->abort("an unknown exception");
      runner.clear();
      throw;
    }
  }
};

namespace {

// The checks and the runner both constructors share; the transport first: it refuses a schedule
// or device the group cannot carry, and a refused constructor must leave the caller's module
// where it was.
void set_up(DistributedPipeline::Impl& im,
            const nn::Sequential& stage_module,
            int64_t stage,
            const dist::ProcessGroupPtr& pg,
            const std::vector<int>& stage_ranks,
            torch::Device device,
            LossFn loss,
            const PipelineOptions& options) {
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
  im.transport = make_process_group_transport(pg, stage_ranks, device, options.schedule());
  auto& r = im.runner;
  r.module = stage_module;
  r.device = device;
  r.index = stage;
  r.count = p;
  r.loss = std::move(loss);
  r.options = options;
  r.transport = im.transport.get();
}

}  // namespace

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
  set_up(*impl_, stage_module, stage, pg, stage_ranks, device, std::move(loss), options);
  stage_module->to(device);
  if (data_parallel_group != nullptr) {
    impl_->ddp =
        std::make_unique<DistributedDataParallel>(stage_module, data_parallel_group, ddp_options);
    impl_->runner.ddp = impl_->ddp.get();
  }
}

DistributedPipeline::DistributedPipeline(FullyShardedDataParallel& fsdp,
                                         int64_t stage,
                                         dist::ProcessGroupPtr pg,
                                         std::vector<int> stage_ranks,
                                         torch::Device device,
                                         LossFn loss,
                                         PipelineOptions options)
    : impl_(std::make_unique<Impl>()) {
  // FSDP placed its shards when it was built; they stay where they are.
  set_up(*impl_, fsdp.module(), stage, pg, stage_ranks, device, std::move(loss), options);
  impl_->runner.fsdp = &fsdp;
}

DistributedPipeline::~DistributedPipeline() = default;

torch::Tensor DistributedPipeline::step(const torch::Tensor& input, const torch::Tensor& target) {
  return step(input, target, impl_->runner.options.chunks());
}

torch::Tensor DistributedPipeline::step(const torch::Tensor& input,
                                        const torch::Tensor& target,
                                        int64_t chunks) {
  auto& r = impl_->runner;
  const int64_t m = chunks;
  TORCH_CHECK(m >= 1, "pipeline: chunks must be >= 1, got ", m);
  // Bad input is refused before any message moves: the pipeline stays usable.
  std::vector<at::Tensor> inputs;
  std::vector<at::Tensor> targets;
  if (r.index == 0) {
    inputs = micro_batches(input, m, "input");
  }
  if (r.is_last()) {
    targets = micro_batches(target, m, "target");
  }
  r.inputs = std::move(inputs);
  r.targets = std::move(targets);
  if (r.is_last()) {
    r.batch = target.size(0);
  }
  impl_->run(actions(r.options.schedule(), r.index, r.count, m), /*training=*/true);
  r.inputs.clear();
  r.targets.clear();
  return r.is_last() ? r.loss_sum : at::Tensor();
}

torch::Tensor DistributedPipeline::forward(const torch::Tensor& input, int64_t chunks) {
  auto& r = impl_->runner;
  TORCH_CHECK(chunks >= 1, "pipeline: chunks must be >= 1, got ", chunks);
  std::vector<at::Tensor> inputs;
  if (r.index == 0) {
    inputs = micro_batches(input, chunks, "input");
  }
  r.inputs = std::move(inputs);
  impl_->run(forwards_only(chunks), /*training=*/false);
  r.inputs.clear();
  if (!r.is_last()) {
    return at::Tensor();
  }
  at::Tensor out = torch::cat(r.outputs, 0);
  r.outputs.clear();
  return out;
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
