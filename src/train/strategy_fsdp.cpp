// --strategy fsdp: each rank keeps a shard of every unit's parameters, gradients and optimizer
// state (FullyShardedDataParallel); its checkpoints are sharded (fsdp_checkpoint.h). On a device
// mesh (TrainerOptions::mesh) a gpt() model is first split by tensor parallelism over "tp"
// (models/gpt_parallel.h), then sharded over "dp_shard" and replicated over "dp_replicate"
// (HSDP), as torchtitan's parallelize applies them.

#include "strategy_mesh.h"

#include "paratrain/base/option_error.h"
#include "paratrain/models/gpt.h"
#include "paratrain/models/gpt_parallel.h"
#include "paratrain/optim/fused.h"
#include "paratrain/parallel/device_mesh.h"
#include "paratrain/parallel/fsdp_checkpoint.h"
#include "paratrain/parallel/fully_sharded_data_parallel.h"
#include "paratrain/parallel/tensor_parallel.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace paratrain::train_internal {

amp::AmpOptions sharded_scaler(const TrainerOptions& o) {
  amp::AmpOptions amp = o.amp();
  amp.scaler(amp::GradScalerOptions(amp.scaler()).process_group(o.process_group()));
  return amp;
}

MeshParts make_mesh(const TrainerOptions& o, const torch::nn::Sequential& model) {
  MeshParts parts;
  const MeshOptions& m = o.mesh();
  if (!m.is_mesh()) {
    return parts;
  }
  const dist::ProcessGroupPtr& pg = o.process_group();
  parts.mesh = std::make_unique<DeviceMesh>(
      pg, mesh_dims(pg->size(), m.dp_replicate(), m.dp_shard(), m.tp(), m.pp()));
  if (m.tp() > 1) {
    TORCH_CHECK(
        models::gpt_context(model) > 0, "tensor parallelism (tp ", m.tp(),
        ") has a plan for gpt() models only (--model gpt, gpt2, ...); this model is not one");
    parts.loss_parallel = m.loss_parallel();
    parts.layout = parallelize_module(
        model.ptr(), parts.tp(),
        models::gpt_parallelize_plan(model, m.tp(),
                                     models::GptParallelOptions()
                                         .sequence_parallel(m.sequence_parallel())
                                         .loss_parallel(m.loss_parallel())));
  }
  return parts;
}

void check_saved_by_fsdp(const CheckpointState& s, const nlohmann::json& meta) {
  TORCH_CHECK(meta.contains("fsdp"), "checkpoint ", s.path,
              " was not saved by the fsdp strategy; resume it with the strategy that saved it (",
              meta.value("strategy", std::string("?")), ")");
}

FsdpOptions mesh_fsdp_options(const TrainerOptions& o, const MeshParts& parts) {
  FsdpOptions f = o.fsdp();
  if (parts.mesh && parts.mesh->has("dp_replicate")) {
    f.replicate_group((*parts.mesh)["dp_replicate"]);
  }
  return f;
}

namespace {

class FsdpStrategy : public TrainStrategy {
 public:
  FsdpStrategy(const TrainerOptions& o, torch::nn::Sequential model)
      : TrainStrategy(o, std::move(model), o.device(), sharded_scaler(o)),
        parts_(make_mesh(o, model_)),
        store_(make_offload_store(o)),
        fsdp_(model_,
              parts_.mesh ? (*parts_.mesh)["dp_shard"] : o.process_group(),
              mesh_fsdp_options(o, parts_).offload(FsdpOffloadPolicy()
                                                       .store(store_)
                                                       .gradients(o.offload().gradients())
                                                       .params(o.offload().params()))) {
    // The optimizer in backward: each unit steps as its gradient is final, its moments streaming
    // while backward computes the next units. Not when something must see every gradient before
    // any step (clipping, loss scaling), nor with offloaded gradients (step() reads those).
    if (o.offload().optimizer() && !o.offload().gradients() && o.clip_grad_norm() == 0 &&
        !mp_->loss_scaling()) {
      steps_in_backward_ = true;
      fsdp_.register_post_accumulate_grad_hook([this](const torch::Tensor& shard) {
        if (in_backward_ != nullptr && !hold_steps_) {
          in_backward_->step_parameter(shard);
        }
      });
    }
  }

  std::optional<std::pair<int, int>> data_rank() const override {
    if (!parts_.mesh) {
      return std::nullopt;
    }
    return std::make_pair(parts_.mesh->local_rank("dp"), parts_.mesh->size("dp"));
  }

  std::unique_ptr<torch::optim::Optimizer> make_optimizer() const override {
    auto optimizer = paratrain::make_optimizer(
        fsdp_.parameters(), OptimizerOptions(options_.optimizer())
                                .offload(options_.offload().optimizer() ? store_ : nullptr));
    in_backward_ = dynamic_cast<optim::FusedOptimizer*>(optimizer.get());
    return optimizer;
  }

  void zero_grad(torch::optim::Optimizer& optimizer) override {
    optimizer.zero_grad();
    fsdp_.discard_offloaded_gradients();
  }

  torch::Tensor forward_backward(const torch::Tensor& input,
                                 const torch::Tensor& target,
                                 bool last) override {
    fsdp_.set_requires_gradient_sync(last);
    return TrainStrategy::forward_backward(input, target, last);
  }

  // Under loss parallel the logits leave the head split by the vocabulary: whole for evaluation.
  torch::Tensor forward(const torch::Tensor& input) override {
    const torch::Tensor out = fsdp_.forward(input);
    return parts_.loss_parallel ? tensor_parallel_all_gather(out, -1, parts_.tp()) : out;
  }

  std::optional<data::Batch> next_val_batch(data::DataLoader& loader,
                                            std::optional<data::Batch>& last) override;

  double clip_grad_norm_(double max_norm) override {
    return parts_.mesh && parts_.mesh->has("tp")
               ? fsdp_.clip_grad_norm_(max_norm, parts_.layout, parts_.tp())
               : fsdp_.clip_grad_norm_(max_norm);
  }

  void capture(CheckpointState& s, torch::optim::Optimizer& optimizer) override {
    if (parts_.mesh) {  // each world rank's file holds its shards of its tensor-parallel parts
      capture_sharded_state(fsdp_, &optimizer, s, *parts_.mesh, parts_.layout);
    } else {
      capture_sharded_state(fsdp_, &optimizer, s);
    }
  }

  // The layout's checks (units, names, shapes) come with the load (restore_sharded_state).
  std::string saved_model_difference(const CheckpointState&) const override { return ""; }

  // Any mesh's checkpoint, and plain FSDP's, resumes on any mesh: resharded as it loads.
  void restore(const CheckpointState& s,
               const nlohmann::json& meta,
               torch::optim::Optimizer& optimizer) override {
    check_saved_by_fsdp(s, meta);
    if (parts_.mesh) {
      restore_sharded_state(s, fsdp_, &optimizer, *parts_.mesh, parts_.layout);
    } else {
      restore_sharded_state(s, fsdp_, &optimizer);
    }
  }

  TensorMap weights() override {
    TensorMap state;
    auto full = fsdp_.full_state();
    if (parts_.mesh && parts_.mesh->has("tp")) {
      full = tensor_parallel_full_state(full, parts_.layout, parts_.tp());
    }
    for (auto& kv : full) {
      state[kv.first] = kv.second;
    }
    for (const auto& b : model_->named_buffers()) {
      state[b.key()] = b.value();
    }
    return state;
  }

 protected:
  torch::Tensor train_forward(const torch::Tensor& input) override { return fsdp_.forward(input); }
  torch::Tensor train_loss(const torch::Tensor& output,
                           const torch::Tensor& target) const override {
    torch::Tensor loss = parts_.loss_parallel
                             ? loss_parallel_cross_entropy(output, target, parts_.tp())
                             : loss_of(output, target);
    if (steps_in_backward_) {
      // A loss that is not finite steps nothing in backward: the Trainer stops on it (or steps
      // after backward, as without the optimizer in backward).
      hold_steps_ = !std::isfinite(loss.detach().item<double>());
    }
    return loss;
  }

 private:
  MeshParts parts_;
  std::shared_ptr<optim::OffloadStore> store_;  // before fsdp_, which binds its shards in it
  FullyShardedDataParallel fsdp_;
  // The optimizer the gradient hook steps (the one make_optimizer made, which the Trainer keeps).
  mutable optim::FusedOptimizer* in_backward_ = nullptr;
  bool steps_in_backward_ = false;
  mutable bool hold_steps_ = false;  // this batch's loss is not finite
};

std::optional<data::Batch> FsdpStrategy::next_val_batch(data::DataLoader& loader,
                                                        std::optional<data::Batch>& last) {
  return next_val_batch_in_step(loader, last, options_.process_group(), device_);
}

}  // namespace

std::optional<data::Batch> next_val_batch_in_step(data::DataLoader& loader,
                                                  std::optional<data::Batch>& last,
                                                  const dist::ProcessGroupPtr& pg,
                                                  torch::Device device) {
  std::optional<data::Batch> b = loader.next();
  // [any rank has a batch, any rank has had none at all]: every rank decides alike, so a rank
  // without data fails together with the others instead of leaving them in a collective.
  torch::Tensor flags =
      torch::tensor({b ? 1.0 : 0.0, b || last ? 0.0 : 1.0}, torch::kDouble).to(device);
  pg->allreduce(flags, dist::ReduceOp::kMax)->wait();
  flags = flags.cpu();
  if (flags[0].item<double>() == 0) {
    return std::nullopt;
  }
  TORCH_CHECK(flags[1].item<double>() == 0,
              "fsdp evaluation: a rank has no validation batch "
              "while others have one; use a validation set of at least one batch per rank");
  if (b) {
    last = b;
    return b;
  }
  return data::Batch{last->data, torch::empty({0}, last->target.options())};
}

namespace {

void check_mesh_options(const TrainerOptions& o) {
  const MeshOptions& m = o.mesh();
  PARATRAIN_CHECK_OPTION(m.dp_replicate() >= 1 && m.tp() >= 1 && m.pp() >= 1 &&
                             (m.dp_shard() >= 1 || m.dp_shard() == -1),
                         "mesh", "the mesh's degrees must be >= 1 (dp_shard -1: the rest), got ",
                         "dp_replicate ", m.dp_replicate(), ", dp_shard ", m.dp_shard(), ", tp ",
                         m.tp(), ", pp ", m.pp());
  PARATRAIN_CHECK_OPTION(m.pp() == 1 || o.chunks() <= o.batch_size(), "chunks", "chunks (",
                         o.chunks(), ") is larger than batch_size (", o.batch_size(),
                         "): a micro-batch needs a sample");
  if (o.process_group() != nullptr) {
    const int64_t world = o.process_group()->size();
    const int64_t others = int64_t{m.dp_replicate()} * m.tp() * m.pp();
    const int64_t shard = m.dp_shard() == -1 ? world / std::max<int64_t>(1, others) : m.dp_shard();
    PARATRAIN_CHECK_OPTION(others * shard == world, "mesh", "dp_replicate ", m.dp_replicate(),
                           " x dp_shard ",
                           m.dp_shard() == -1 ? "-1 (the rest)" : std::to_string(m.dp_shard()),
                           " x tp ", m.tp(), " x pp ", m.pp(), " does not make the world's ", world,
                           " ranks; choose degrees whose product is the world size");
  }
}

void check_fsdp_options(const TrainerOptions& o) {
  PARATRAIN_CHECK_OPTION(
      o.amp().opt_level() == amp::OptLevel::kO0 || o.amp().opt_level() == amp::OptLevel::kO1, "amp",
      "strategy fsdp keeps fp32 shards as the master weights: use amp O0 or O1 "
      "(autocast), or bf16 shards through mixed_precision, not ",
      amp::to_string(o.amp().opt_level()));
  PARATRAIN_CHECK_OPTION(o.check_replicas() == 0, "check_replicas",
                         "check_replicas compares DDP's replicas; strategy fsdp keeps one shard "
                         "per rank, not replicas");
  check_mesh_options(o);
}

}  // namespace

StrategyKind fsdp_strategy() {
  return {Strategy::kFSDP,
          "fsdp",
          /*takes_process_group=*/true,
          [](const TrainerOptions& o) {
            return o.mesh().is_mesh() || o.mesh().dp_shard() != -1
                       ? std::vector<std::string>{"mesh"}
                       : std::vector<std::string>{};
          },
          "lays the ranks out as a device mesh for FSDP and tensor parallelism",
          check_fsdp_options,
          [](const TrainerOptions& o, torch::nn::Sequential model) {
            return o.mesh().pp() > 1 ? make_fsdp_pipeline(o, std::move(model))
                                     : make_strategy<FsdpStrategy>(o, std::move(model));
          }};
}

}  // namespace paratrain::train_internal
