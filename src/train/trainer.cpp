// The Trainer: its options, optimizer and loaders, the training loop, the evaluation and the
// metrics. Its strategy (strategy.h, one file each) says how a step runs across devices and ranks;
// capture, restore and resume of the training state are in trainer_state.cpp; Trainer::Impl is in
// trainer_impl.h.

#include "trainer_impl.h"

#include "paratrain/base/option_error.h"
#include "paratrain/data/device_prefetcher.h"
#include "paratrain/data/sampler.h"
#include "paratrain/optim/fused.h"
#include "paratrain/util/cpu_kernels.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <limits>
#include <map>
#include <optional>

namespace paratrain {

using Clock = std::chrono::steady_clock;

std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<torch::Tensor> params,
                                                        const OptimizerOptions& o) {
  TORCH_CHECK(o.lr() > 0 && o.weight_decay() >= 0 && o.momentum() >= 0 && o.eps() > 0,
              "optimizer: lr and eps must be > 0, momentum and weight_decay >= 0 (got lr ", o.lr(),
              ", momentum ", o.momentum(), ", weight_decay ", o.weight_decay(), ", eps ", o.eps(),
              ")");
  TORCH_CHECK(o.offload() == nullptr || o.kind() != "sgd",
              "optimizer: offload keeps the moments of adam and adamw; sgd's momentum stays in "
              "memory (choose adam or adamw)");
  if (o.kind() == "sgd") {
    const auto sgd =
        torch::optim::SGDOptions(o.lr()).momentum(o.momentum()).weight_decay(o.weight_decay());
    if (o.fused()) {
      return std::make_unique<optim::FusedSGD>(params, sgd);
    }
    return std::make_unique<torch::optim::SGD>(params, sgd);
  }
  TORCH_CHECK(o.beta1() >= 0 && o.beta1() < 1 && o.beta2() >= 0 && o.beta2() < 1,
              "optimizer: betas must be in [0, 1), got (", o.beta1(), ", ", o.beta2(), ")");
  const auto betas = std::make_tuple(o.beta1(), o.beta2());
  if (o.kind() == "adam") {
    const auto adam =
        torch::optim::AdamOptions(o.lr()).betas(betas).eps(o.eps()).weight_decay(o.weight_decay());
    if (o.fused() || o.offload() != nullptr) {
      auto fused = std::make_unique<optim::FusedAdam>(params, adam);
      fused->offload(o.offload());
      return fused;
    }
    return std::make_unique<torch::optim::Adam>(params, adam);
  }
  TORCH_CHECK(o.kind() == "adamw", "unknown optimizer '", o.kind(), "': choose sgd, adam or adamw");
  const auto adamw =
      torch::optim::AdamWOptions(o.lr()).betas(betas).eps(o.eps()).weight_decay(o.weight_decay());
  if (o.fused() || o.offload() != nullptr) {
    auto fused = std::make_unique<optim::FusedAdamW>(params, adamw);
    fused->offload(o.offload());
    return fused;
  }
  return std::make_unique<torch::optim::AdamW>(params, adamw);
}

double clip_grad_norm_(const std::vector<torch::Tensor>& parameters, double max_norm) {
  // Squares summed per device first: one small copy per device, not one per parameter (and
  // libtorch's clip_grad_norm_ stacks norms that may sit on different devices).
  std::map<std::string, torch::Tensor> per_device;
  for (const auto& p : parameters) {
    if (!p.grad().defined()) {
      continue;
    }
    torch::Tensor sq = p.grad().detach().to(torch::kFloat).pow(2).sum();
    auto& acc = per_device[p.device().str()];
    acc = acc.defined() ? acc + sq : sq;
  }
  double total = 0;
  for (const auto& kv : per_device) {
    total += kv.second.to(torch::kCPU, torch::kDouble).item<double>();
  }
  const double norm = std::sqrt(total);
  if (max_norm > 0) {
    const double coef = max_norm / (norm + 1e-6);
    if (coef < 1) {  // also false for a NaN norm: the scaler skips that step anyway
      torch::NoGradGuard no_grad;
      for (const auto& p : parameters) {
        if (p.grad().defined()) {
          p.grad().mul_(coef);
        }
      }
    }
  }
  return norm;
}

namespace {

void check_checkpoint_options(const TrainerOptions& o) {
  PARATRAIN_CHECK_OPTION(o.checkpoint_every() == 0 || !o.checkpoint_dir().empty(), "checkpoint_dir",
                         "checkpoint_every needs checkpoint_dir");
  PARATRAIN_CHECK_OPTION(!o.checkpoint_every_epoch() || !o.checkpoint_dir().empty(),
                         "checkpoint_dir", "checkpoint_every_epoch needs checkpoint_dir");
  PARATRAIN_CHECK_OPTION(o.resume() != "auto" || !o.checkpoint_dir().empty(), "checkpoint_dir",
                         "resume auto needs checkpoint_dir (where to look)");
  PARATRAIN_CHECK_OPTION(!o.start_fresh_if_damaged() || o.resume() == "auto",
                         "start_fresh_if_damaged",
                         "start_fresh_if_damaged says what resume auto does when every checkpoint "
                         "is damaged: add resume auto");
}

}  // namespace

void check_trainer_options(const TrainerOptions& o) {
  auto at_least = [](const char* field, int64_t value, int64_t least, const char* why = "") {
    PARATRAIN_CHECK_OPTION(value >= least, field, field, " must be >= ", least, ", got ", value,
                           why);
  };
  at_least("epochs", o.epochs(), 1);
  at_least("batch_size", o.batch_size(), 1);
  at_least("accumulate", o.accumulate(), 1);
  at_least("steps_per_epoch", o.steps_per_epoch(), 0);
  at_least("workers", o.workers(), 0, " (0 loads data in the training thread)");
  PARATRAIN_CHECK_OPTION(o.clip_grad_norm() >= 0, "clip_grad_norm",
                         "clip_grad_norm must be >= 0, got ", o.clip_grad_norm());
  at_least("checkpoint_every", o.checkpoint_every(), 0);
  at_least("keep", o.keep(), 1, ": with no checkpoint kept, a run could never be resumed");
  at_least("log_every", o.log_every(), 0);
  at_least("check_replicas", o.check_replicas(), 0);
  check_checkpoint_options(o);
  train_internal::check_strategy_options(o);
  train_internal::check_offload_options(o);
  PARATRAIN_CHECK_OPTION(o.zero_checkpoint() == "consolidated" || o.zero_checkpoint() == "sharded",
                         "zero_checkpoint", "zero_checkpoint is '", o.zero_checkpoint(),
                         "': use consolidated or sharded");
  PARATRAIN_CHECK_OPTION(o.zero_checkpoint() == "consolidated" || o.zero(), "zero_checkpoint",
                         "zero_checkpoint says how zero's shards are saved: add zero");
  check_lr_schedule(o.lr_schedule());
  try {
    PARATRAIN_CHECK_OPTION(Json::parse(o.config()).is_object(), "config",
                           "config must be a JSON object");
  } catch (const Json::exception& e) {
    PARATRAIN_CHECK_OPTION(false, "config", "config is not JSON: ", e.what());
  }
}

void Trainer::Impl::check_options() const {
  check_trainer_options(o);
  const bool ranks = train_internal::strategy_kind(o.strategy()).takes_process_group;
  std::string with;  // the strategies that take one
  for (const auto& kind : train_internal::strategy_kinds()) {
    if (kind.takes_process_group) {
      with += (with.empty() ? "" : " or ") + std::string(kind.name);
    }
  }
  PARATRAIN_CHECK_OPTION(ranks == (o.process_group() != nullptr), "process_group", "strategy ",
                         to_string(o.strategy()),
                         ranks ? " needs a process_group"
                               : " takes no process_group (it goes with strategy " + with + ")");
}

void Trainer::Impl::build_strategy() {
  if (o.process_group()) {
    rank = o.process_group()->rank();
    world = o.process_group()->size();
  }
  strategy = train_internal::strategy_kind(o.strategy()).make(o, model);
  data_rank = rank;
  data_world = world;
  if (const auto dp = strategy->data_rank()) {
    std::tie(data_rank, data_world) = *dp;
  }
  device = strategy->device();
  mp = &strategy->mixed_precision();
  opt = strategy->make_optimizer();
  schedule = std::make_unique<LRSchedule>(*opt, o.lr_schedule());
}

void Trainer::Impl::refresh_batches() {
  int64_t batches = static_cast<int64_t>(loader->num_batches(sampler->num_samples()));
  if (o.steps_per_epoch() > 0) {
    batches = std::min(batches, o.steps_per_epoch() * o.accumulate());
  }
  if (epoch_cap > 0) {
    batches = std::min(batches, epoch_cap);
  }
  batches_per_epoch = batches;
}

void Trainer::Impl::build_loaders() {
  sampler = std::make_shared<data::DistributedSampler>(train->size(), data_world, data_rank,
                                                       /*shuffle=*/true, o.seed());
  loader =
      std::make_unique<data::DataLoader>(train,
                                         data::LoaderOptions(static_cast<size_t>(o.batch_size()))
                                             .workers(o.workers())
                                             .pin_memory(device.is_cuda())
                                             .seed(o.seed())
                                             .persistent_workers(true),
                                         sampler);
  refresh_batches();
  if (val) {
    // Each rank evaluates a contiguous share of the validation set.
    const size_t n = val->size();
    std::vector<size_t> share;
    const auto r = static_cast<size_t>(data_rank), w = static_cast<size_t>(data_world);
    for (size_t i = n * r / w; i < n * (r + 1) / w; ++i) {
      share.push_back(i);
    }
    const int64_t eval_batch = o.eval_batch_size() > 0 ? o.eval_batch_size() : o.batch_size();
    val_loader =
        std::make_unique<data::DataLoader>(val,
                                           data::LoaderOptions(static_cast<size_t>(eval_batch))
                                               .workers(o.workers())
                                               .persistent_workers(true),
                                           std::make_shared<data::FixedSampler>(std::move(share)));
  }
}

// A metrics row as TensorBoard scalars at its global step: "train/loss" for step rows,
// "epoch/val_accuracy" for epoch rows; a resume purges what the lost steps had logged.
void Trainer::Impl::write_tensorboard(const Json& row) {
  const int64_t step = row.at("step").get<int64_t>();
  if (row.contains("resumed_from")) {
    tb->purge(step + 1);  // the rows of later steps were lost work, about to be redone
    tb->flush();
    return;
  }
  const std::string prefix = row.contains("val_accuracy") ? "epoch/" : "train/";
  for (const auto& [key, value] : row.items()) {
    if (key == "step" || key == "epoch" || key == "batch" || !value.is_number()) {
      continue;
    }
    const double v = value.get<double>();
    if (!std::isnan(v)) {  // NaN: not measured at this step (the gradient norm)
      tb->add_scalar(prefix + key, v, step);
    }
  }
  tb->flush();  // a killed run keeps every row written so far
}

void Trainer::Impl::write_metrics(const Json& row) {
  if (metrics.is_open()) {
    metrics << row.dump() << "\n";
    metrics.flush();  // a killed run keeps every row written so far
  }
  if (tb) {
    write_tensorboard(row);
  }
}

// Clip or measure at the true scale, then step (skipped by the scaler on inf/NaN gradients).
StepInfo Trainer::Impl::optimizer_step(const torch::Tensor& loss, bool log) {
  trace::Span span("optimizer step", "compute");
  StepInfo info;
  const bool measure = log || o.clip_grad_norm() > 0;
  if (measure) {
    mp->unscale_(*opt);
    info.grad_norm = strategy->clip_grad_norm_(o.clip_grad_norm());
  }
  info.loss_scale = mp->loss_scaling() ? mp->scaler().get_scale() : 1.0;
  info.stepped = mp->step(*opt);
  ++global_step;
  if (o.schedule_per_step()) {
    schedule->step();
  }
  if (log) {
    info.loss = loss.detach().to(torch::kCPU, torch::kDouble).item<double>();
  }
  info.lr = schedule->lr();
  info.global_step = global_step;
  info.epoch = epoch;
  return info;
}

void Trainer::Impl::train_epoch(double& loss_sum_out, int64_t& samples) {
  model->train();
  loader->set_epoch(static_cast<uint64_t>(epoch), static_cast<size_t>(batch));
  loader->reset_stats();
  log_clock = std::chrono::steady_clock::now();
  log_samples = 0;
  // Batches are moved (and transformed) on the device one batch ahead (DevicePrefetcher).
  data::DevicePrefetcher batches(*loader, device, o.input_transform());
  // Summed on the device: reading the loss every step would make the host wait for the device.
  torch::Tensor loss_sum;
  const bool guard_loss = o.stop_on_non_finite() && !mp->loss_scaling();
  while (batch < batches_per_epoch) {
    std::optional<data::Batch> b;
    {
      trace::Span span("data wait", "data");
      b = batches.next();
    }
    if (!b) {
      break;
    }
    const bool first = batch % o.accumulate() == 0;
    const bool last = (batch + 1) % o.accumulate() == 0 || batch + 1 == batches_per_epoch;
    if (first) {
      strategy->zero_grad(*opt);
    }
    // The batch's mean loss, unscaled.
    const torch::Tensor loss = strategy->forward_backward(b->data, b->target, last);
    if (guard_loss) {
      check_finite(loss);
    }
    const torch::Tensor weighted =
        loss.detach().to(torch::kDouble) * static_cast<double>(b->target.size(0));
    loss_sum = loss_sum.defined() ? loss_sum + weighted.to(loss_sum.device()) : weighted;
    samples += b->target.size(0);
    log_samples += b->target.size(0);
    if (!last) {
      ++batch;
      continue;
    }
    end_step(loss);
  }
  if (loss_sum.defined()) {
    loss_sum_out += loss_sum.to(torch::kCPU).item<double>();
  }
}

// stop_on_non_finite without loss scaling: NonFiniteLoss naming the step, the batch and the rank.
void Trainer::Impl::check_finite(const torch::Tensor& loss) const {
  if (!std::isfinite(loss.detach().to(torch::kCPU, torch::kDouble).item<double>())) {
    throw NonFiniteLoss(
        "the loss is " + std::to_string(loss.detach().to(torch::kCPU).item<double>()) +
        " at step " + std::to_string(global_step + 1) + " (epoch " + std::to_string(epoch + 1) +
        ", batch " + std::to_string(batch + 1) + ") on rank " + std::to_string(rank) +
        ": lower the learning rate, clip gradients, or check the data");
  }
}

// After the last batch of an accumulation: the optimizer step, then its metrics row, the replica
// check, the checkpoint and the step callbacks.
void Trainer::Impl::end_step(const torch::Tensor& loss) {
  const bool log = is_log_step();
  StepInfo info = optimizer_step(loss, log);
  ++batch;
  info.batch = batch;
  if (log) {
    write_step_row(info);
  }
  strategy->after_step(global_step);
  if (o.checkpoint_every() > 0 && global_step % o.checkpoint_every() == 0) {
    trace::Span span("checkpoint (copy to host)", "checkpoint");
    ckpt->save(capture());
  }
  for (auto& cb : step_callbacks) {
    cb(info);
  }
}

void Trainer::Impl::write_step_row(const StepInfo& info) {
  const auto now = std::chrono::steady_clock::now();
  // Every data-parallel rank trains on as many samples (a mesh's tp ranks on the same ones); dp
  // and pipeline batches are whole.
  const double images_per_sec =
      static_cast<double>(log_samples * data_world) /
      std::max(1e-9, std::chrono::duration<double>(now - log_clock).count());
  log_clock = now;
  log_samples = 0;
  write_metrics(Json{{"step", info.global_step},
                     {"epoch", epoch + 1},
                     {"batch", batch},
                     {"loss", info.loss},
                     {"lr", info.lr},
                     {"grad_norm", info.grad_norm},
                     {"loss_scale", info.loss_scale},
                     {"images_per_sec", images_per_sec},
                     {"stepped", info.stepped}});
}

// Each rank writes its part; rank 0 merges them into options.trace once all are written.
void Trainer::Impl::write_trace(const trace::Tracer& tracer) {
  if (!o.process_group()) {
    tracer.write(o.trace());
    return;
  }
  const std::string mine = o.trace() + ".rank-" + std::to_string(rank);
  tracer.write(mine);
  o.process_group()->barrier()->wait();
  if (rank == 0) {
    std::vector<std::string> parts;
    for (int r = 0; r < world; ++r) {
      parts.push_back(o.trace() + ".rank-" + std::to_string(r));
    }
    trace::merge(parts, o.trace());
    for (const auto& p : parts) {
      std::remove(p.c_str());
    }
  }
}

// Accuracy and mean loss over the validation set: per sample for classifiers, per token for
// sequences. Under ddp one allreduce adds up every rank's share, for every model alike.
Trainer::Impl::Evaluation Trainer::Impl::evaluate() {
  if (!val_loader) {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    return {nan, nan};
  }
  model->eval();
  int64_t correct = 0;
  int64_t seen = 0;
  double loss_sum = 0;
  {
    torch::NoGradGuard no_grad;
    val_loader->set_epoch(0);
    std::optional<data::Batch> last;
    while (auto b = strategy->next_val_batch(*val_loader, last)) {
      torch::Tensor x = b->data.to(device);
      if (o.input_transform()) {
        x = o.input_transform()(x);
      }
      x = mp->cast_input(x);
      auto autocast = mp->autocast();
      auto out = strategy->forward(x);
      if (b->target.numel() == 0) {
        continue;  // a forward that only kept the ranks in step (next_val_batch)
      }
      const torch::Tensor target = b->target.to(out.device());
      const bool sequence = train_internal::is_sequence(out, target);
      const int64_t count = sequence ? target.numel() : target.size(0);
      correct += out.argmax(sequence ? -1 : 1).eq(target).sum().item<int64_t>();
      loss_sum += strategy->loss_of(out, target).to(torch::kCPU, torch::kDouble).item<double>() *
                  static_cast<double>(count);
      seen += count;
    }
  }
  model->train();
  at::Tensor totals = torch::tensor(
      {static_cast<double>(correct), static_cast<double>(seen), loss_sum}, torch::kDouble);
  if (o.process_group()) {
    totals = totals.to(device);
    o.process_group()->allreduce(totals)->wait();
    totals = totals.cpu();
  }
  const double counted = std::max(1.0, totals[1].item<double>());
  return {totals[0].item<double>() / counted, totals[2].item<double>() / counted};
}

// One epoch: training, evaluation, the epoch's totals over the ranks, the schedule, the metrics
// row and the epoch's checkpoint.
EpochResult Trainer::Impl::run_epoch() {
  const auto start = Clock::now();
  double loss_sum = 0;
  int64_t samples = 0;
  train_epoch(loss_sum, samples);
  EpochResult r;
  r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  r.data_wait_seconds = loader->stats().wait_seconds;
  r.epoch = epoch;
  const Evaluation evaluation = evaluate();
  r.val_accuracy = evaluation.accuracy;
  r.val_loss = evaluation.loss;
  at::Tensor totals = torch::tensor({loss_sum, static_cast<double>(samples)}, torch::kDouble);
  if (o.process_group()) {
    totals = totals.to(device);
    o.process_group()->allreduce(totals)->wait();
    totals = totals.cpu();
  }
  // No sample trained by any rank: resumed from a checkpoint of the epoch's last step. Its loss
  // and throughput were the earlier run's (which may have died before it reported them).
  r.trained = totals[1].item<double>() > 0;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  r.train_loss = r.trained ? totals[0].item<double>() / totals[1].item<double>() : nan;
  // Each of a mesh's tp ranks counted the same samples.
  const double copies = static_cast<double>(world / data_world);
  r.images_per_sec =
      r.trained ? totals[1].item<double>() / copies / std::max(1e-9, r.seconds) : nan;
  r.lr = schedule->lr();
  if (!o.schedule_per_step()) {
    schedule->step();
  }
  ++epoch;
  batch = 0;
  if (epoch_start != 0 || epoch_cap != 0) {  // the resharded epoch is over
    epoch_start = 0;
    epoch_cap = 0;
    sampler->set_start_index(0);
    refresh_batches();
  }
  r.global_step = global_step;
  write_epoch_row(r, r.trained);
  if (o.checkpoint_every_epoch()) {
    trace::Span span("checkpoint (copy to host)", "checkpoint");
    ckpt->save(capture());
  }
  return r;
}

// `trained`: whether any rank trained a sample in this attempt's epoch.
void Trainer::Impl::write_epoch_row(const EpochResult& r, bool trained) {
  if (trained) {
    write_metrics(Json{{"epoch", r.epoch + 1},
                       {"step", r.global_step},
                       {"train_loss", r.train_loss},
                       {"val_accuracy", r.val_accuracy},
                       {"val_loss", r.val_loss},
                       {"lr", r.lr},
                       {"images_per_sec", r.images_per_sec},
                       {"seconds", r.seconds},
                       {"data_wait_seconds", r.data_wait_seconds}});
  } else {
    // Resumed from a checkpoint at the epoch's last step: the training stats belong to the
    // attempt that trained it (which may have died before writing them); the evaluation is
    // this attempt's.
    write_metrics(Json{{"epoch", r.epoch + 1},
                       {"step", r.global_step},
                       {"val_accuracy", r.val_accuracy},
                       {"val_loss", r.val_loss},
                       {"lr", r.lr},
                       {"resumed", true}});
  }
}

Trainer::Trainer(torch::nn::Sequential model,
                 data::DatasetPtr train,
                 data::DatasetPtr val,
                 TrainerOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.o = std::move(options);
  m.model = std::move(model);
  m.train = std::move(train);
  m.val = std::move(val);
  TORCH_CHECK(m.train, "Trainer: the training set is null");
  cpu::ensure_usable_kernels();  // Note [CPU kernels that do not run]
  m.check_options();
  train_internal::check_offload_space(m.o, m.model);
  m.build_strategy();
  m.build_loaders();
  if (!m.o.checkpoint_dir().empty()) {
    m.ckpt = std::make_unique<Checkpoint>(
        CheckpointOptions(m.o.checkpoint_dir())
            .keep(m.o.keep())
            .collective_device(m.o.process_group() ? m.device : torch::kCPU)
            .any_world_size(m.o.elastic())
            .start_fresh_if_damaged(m.o.start_fresh_if_damaged()),
        m.o.process_group());
    // A fresh run would mix its checkpoints with another run's (and prune its own first).
    PARATRAIN_CHECK_OPTION(!m.o.resume().empty() || m.ckpt->steps().empty(), "checkpoint_dir",
                           "checkpoint_dir '", m.o.checkpoint_dir(),
                           "' holds checkpoints of another run: continue it with resume auto, or "
                           "give an empty checkpoint_dir");
  }
  if (!m.o.tensorboard().empty() && m.rank == 0) {
    m.tb = std::make_unique<tensorboard::SummaryWriter>(m.o.tensorboard());
  }
  if (!m.o.metrics().empty() && m.rank == 0) {
    m.metrics.open(m.o.metrics(), std::ios::app);  // a resumed run goes on in the same file
    TORCH_CHECK(m.metrics.is_open(), "cannot write the metrics file ", m.o.metrics(), ": ",
                std::strerror(errno));
  }
}

Trainer::~Trainer() = default;

std::vector<EpochResult> Trainer::fit() {
  Impl& m = *impl_;
  std::unique_ptr<trace::Tracer> tracer;
  struct Uninstall {
    bool on = false;
    ~Uninstall() {
      if (on) {
        trace::set_current(nullptr);
      }
    }
  } uninstall;
  if (!m.o.trace().empty()) {
    tracer = std::make_unique<trace::Tracer>(m.rank);
    trace::set_current(tracer.get());
    uninstall.on = true;
  }
  // Declared after the tracer, so destroyed before it: a background checkpoint write still
  // under way when fit() throws reports its span to a live tracer.
  struct WaitForWriter {
    Checkpoint* ckpt;
    ~WaitForWriter() {
      if (ckpt != nullptr) {
        try {
          ckpt->wait();
        } catch (const std::exception& e) {
          std::cerr << "paratrain: a checkpoint write failed: " << e.what() << std::endl;
        }
      }
    }
  } wait_for_writer{m.ckpt.get()};
  if (!m.o.resume().empty()) {
    m.resume();
  }
  std::vector<EpochResult> results;
  while (m.epoch < m.o.epochs()) {
    const EpochResult r = m.run_epoch();
    for (auto& cb : m.epoch_callbacks) {
      cb(r);
    }
    results.push_back(r);
  }
  if (m.ckpt) {
    m.ckpt->wait();
  }
  if (tracer) {
    m.write_trace(*tracer);
  }
  return results;
}

double Trainer::evaluate() {
  return impl_->evaluate().accuracy;
}

void Trainer::on_step_end(std::function<void(const StepInfo&)> callback) {
  impl_->step_callbacks.push_back(std::move(callback));
}

void Trainer::on_epoch_end(std::function<void(const EpochResult&)> callback) {
  impl_->epoch_callbacks.push_back(std::move(callback));
}

torch::nn::Sequential& Trainer::model() {
  return impl_->model;
}
torch::optim::Optimizer& Trainer::optimizer() {
  return *impl_->opt;
}
amp::MixedPrecision& Trainer::mixed_precision() {
  return *impl_->mp;
}
TensorMap Trainer::weights() const {
  return impl_->strategy->weights();
}
int64_t Trainer::global_step() const {
  return impl_->global_step;
}
int64_t Trainer::epoch() const {
  return impl_->epoch;
}
const TrainerOptions& Trainer::options() const {
  return impl_->o;
}
std::string Trainer::resumed_from() const {
  return impl_->resumed_from;
}
int64_t Trainer::steps_per_epoch() const {
  const int64_t a = impl_->o.accumulate();
  return (impl_->batches_per_epoch + a - 1) / a;
}

}  // namespace paratrain
