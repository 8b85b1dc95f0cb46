// --strategy fsdp on a mesh with pipeline stages (pp above 1): 3-D parallelism as torchtitan
// composes it. The gpt() model is split by tensor parallelism over "tp" (models/gpt_parallel.h),
// cut into pp stages of consecutive blocks (the embedding with the first, the final LayerNorm and
// the head with the last, the blocks shared out evenly, as torchtitan splits Llama's layers), and
// each rank keeps its stage, sharded by FSDP over "dp_shard" (HSDP over "dp_replicate"). The
// stages run the batch as `chunks` micro-batches under the GPipe or 1F1B schedule
// (pipeline::DistributedPipeline), each stage's gradients reduce-scattered once per step.
//
// The head is tied to the embedding (gpt.h): the last stage keeps a copy of the embedding's
// weight for it. As Megatron-LM's embedding group does, the copy's gradient (averaged over the
// data-parallel ranks) is added to the embedding's before the optimizer step, which the first
// stage takes on its shards; after the step the first stage's updated weight is sent back to the
// copy, so the two never differ.

#include "strategy_mesh.h"

#include "paratrain/models/gpt.h"
#include "paratrain/parallel/fsdp_checkpoint.h"
#include "paratrain/parallel/pipeline.h"
#include "paratrain/util/trace.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <numeric>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace paratrain::train_internal {

namespace {

constexpr const char* kTied = "embed.wte.weight";  // the head's weight too

// Layer counts per stage: the blocks shared out evenly (the first stages take one more when they
// do not divide), the layers before the first block on the first stage, those after the last on
// the last.
std::vector<int64_t> stage_balance(const torch::nn::Sequential& model, int stages) {
  const std::vector<std::string> blocks = models::gpt_block_names(model);
  const auto n = static_cast<int64_t>(blocks.size());
  TORCH_CHECK(n >= stages, "pipeline stages (pp ", stages, ") need a transformer block each, and ",
              "the model has ", n, "; use pp of at most ", n);
  std::vector<std::string> children;
  for (const auto& c : model->named_children()) {
    children.push_back(c.key());
  }
  const auto first = std::find(children.begin(), children.end(), blocks.front()) - children.begin();
  const auto count = static_cast<int64_t>(children.size());
  std::vector<int64_t> balance;
  for (int64_t s = 0; s < stages; ++s) {
    balance.push_back(n / stages + (s < n % stages ? 1 : 0));
  }
  balance.front() += first;
  balance.back() += count - first - n;
  return balance;
}

// Gradients and weights between the stages.
class FsdpPipelineStrategy : public TrainStrategy {
 public:
  FsdpPipelineStrategy(const TrainerOptions& o, torch::nn::Sequential model);
  ~FsdpPipelineStrategy() override {
    if (tied_.defined() && tied_hook_ >= 0) {
      tied_.remove_hook(static_cast<unsigned>(tied_hook_));  // the model may outlive us
    }
  }

  std::optional<std::pair<int, int>> data_rank() const override {
    return std::make_pair(mesh().local_rank("dp"), mesh().size("dp"));
  }
  std::unique_ptr<torch::optim::Optimizer> make_optimizer() const override {
    return paratrain::make_optimizer(fsdp_->parameters(), options_.optimizer());
  }
  torch::Tensor forward_backward(const torch::Tensor& input,
                                 const torch::Tensor& target,
                                 bool last) override;
  torch::Tensor forward(const torch::Tensor& input) override;
  std::optional<data::Batch> next_val_batch(data::DataLoader& loader,
                                            std::optional<data::Batch>& last) override;
  double clip_grad_norm_(double max_norm) override;
  void after_step(int64_t global_step) override {
    (void)global_step;
    send_tied_weight();
  }

  void capture(CheckpointState& s, torch::optim::Optimizer& optimizer) override {
    capture_sharded_state(*fsdp_, &optimizer, s, mesh(), stage_layout_);
  }
  std::string saved_model_difference(const CheckpointState&) const override { return ""; }
  void restore(const CheckpointState& s,
               const nlohmann::json& meta,
               torch::optim::Optimizer& optimizer) override {
    check_saved_by_fsdp(s, meta);
    restore_sharded_state(s, *fsdp_, &optimizer, mesh(), stage_layout_);
    send_tied_weight();
  }
  TensorMap weights() override;

 private:
  const DeviceMesh& mesh() const { return *parts_.mesh; }
  const dist::ProcessGroupPtr& pp() const { return mesh()["pp"]; }
  bool is_first() const { return stage_ == 0; }
  bool is_last() const { return stage_ + 1 == stages_; }
  // Where the tied weight's messages travel: host memory over a group with a CPU engine (gloo's
  // send and recv take no CUDA tensor), the device over NCCL alone, as the pipeline's own.
  torch::Device wire() const { return pp()->moves(torch::kCPU) ? torch::kCPU : device_; }
  void record_layouts();
  std::vector<std::string> stage_units(const TrainerOptions& o) const;
  void hold_tied_copy(const TrainerOptions& o, const torch::Tensor& tied);
  void keep_stage();
  void reduce_tied_gradient();
  void send_tied_weight();
  void clear_tied_gradient();
  // Where the tied weight starts in the first stage's root flat parameter.
  int64_t tied_offset() const;

  MeshParts parts_;
  TensorParallelLayout stage_layout_;  // what tensor parallelism split of this stage
  int stage_ = 0;
  int stages_ = 1;
  std::vector<torch::nn::Sequential> cut_;  // every stage's layers (shared with the model)
  torch::Tensor tied_;                      // the last stage's copy of the tied weight
  std::vector<int64_t> tied_shape_;         // its tensor-parallel part's shape
  torch::TensorOptions tied_options_;
  // The last stage's sum of the copy's gradients, in fp32, since the last optimizer step.
  std::shared_ptr<torch::Tensor> tied_grad_ = std::make_shared<torch::Tensor>();
  int64_t tied_offset_ = 0;  // the first stage's tied_offset()
  int64_t tied_hook_ = -1;   // the hook that sums the copy's gradients
  // Every parameter's shape unsplit, and dtype, as weights() receives it from its stage.
  std::map<std::string, std::pair<std::vector<int64_t>, torch::ScalarType>> whole_;
  std::unique_ptr<FullyShardedDataParallel> fsdp_;
  std::unique_ptr<pipeline::DistributedPipeline> pipe_;
};

FsdpPipelineStrategy::FsdpPipelineStrategy(const TrainerOptions& o, torch::nn::Sequential model)
    : TrainStrategy(o, std::move(model), o.device(), sharded_scaler(o)) {
  TORCH_CHECK(models::gpt_context(model_) > 0, "pipeline stages (pp ", o.mesh().pp(),
              ") are cut between the blocks of gpt() models only (--model gpt, gpt2, ...); this "
              "model is not one");
  parts_ = make_mesh(o, model_);
  stage_ = mesh().local_rank("pp");
  stages_ = mesh().size("pp");
  cut_ = pipeline::split(model_, stage_balance(model_, stages_));
  record_layouts();
  const std::vector<std::string> units = stage_units(o);  // checked for every stage, on every rank
  const torch::Tensor tied = model_->named_parameters()[kTied];
  TORCH_CHECK(tied.requires_grad(), kTied, " does not require grad; pipeline stages train the ",
              "embedding the head is tied to");
  tied_shape_ = tied.sizes().vec();
  tied_options_ = tied.options();
  if (is_last()) {
    hold_tied_copy(o, tied);
  }
  keep_stage();
  fsdp_ = std::make_unique<FullyShardedDataParallel>(cut_[static_cast<size_t>(stage_)],
                                                     mesh()["dp_shard"],
                                                     mesh_fsdp_options(o, parts_).units(units));
  if (is_first()) {
    tied_offset_ = tied_offset();
  }
  std::vector<int> ranks(static_cast<size_t>(stages_));
  std::iota(ranks.begin(), ranks.end(), 0);
  const bool lp = parts_.loss_parallel;
  pipe_ = std::make_unique<pipeline::DistributedPipeline>(
      *fsdp_, stage_, pp(), ranks, device_,
      // Each micro-batch's loss, scaled for the GradScaler and the accumulation.
      [this, lp](const torch::Tensor& out, const torch::Tensor& target) {
        const torch::Tensor l =
            lp ? loss_parallel_cross_entropy(out, target, parts_.tp()) : loss_of(out, target);
        return mp_->scaler().scale(l) / static_cast<double>(options_.accumulate());
      },
      pipeline::PipelineOptions().chunks(o.chunks()).schedule(o.pipeline_schedule()));
  send_tied_weight();  // FSDP kept rank 0's weights: the copy takes them too
}

// Every parameter's whole shape and dtype (what weights() receives from another stage), and what
// tensor parallelism split of this stage.
void FsdpPipelineStrategy::record_layouts() {
  for (const auto& p : model_->named_parameters()) {
    std::vector<int64_t> shape = p.value().sizes().vec();
    auto split = parts_.layout.shards.find(p.key());
    if (split != parts_.layout.shards.end()) {
      const int64_t dim = split->second.dim < 0 ? split->second.dim + p.value().dim()
                                                : split->second.dim;  // Colwise's -1
      shape.at(static_cast<size_t>(dim)) *= parts_.layout.degree;
    }
    whole_[p.key()] = {shape, p.value().scalar_type()};
  }
  stage_layout_.degree = parts_.layout.degree;
  for (const auto& p : cut_[static_cast<size_t>(stage_)]->named_parameters()) {
    auto split = parts_.layout.shards.find(p.key());
    if (split != parts_.layout.shards.end()) {
      stage_layout_.shards.insert(*split);
    }
  }
}

// This stage's FSDP units: the given units (a GPT's blocks by default) it holds. Every rank checks
// every stage, so that a bad list fails everywhere at once rather than on one stage.
std::vector<std::string> FsdpPipelineStrategy::stage_units(const TrainerOptions& o) const {
  const std::vector<std::string> all =
      o.fsdp().units().empty() ? models::gpt_block_names(model_) : o.fsdp().units();
  const std::string holder = std::string(kTied).substr(0, std::string(kTied).find('.'));
  TORCH_CHECK(std::find(all.begin(), all.end(), holder) == all.end(), "fsdp units: '", holder,
              "' holds ", kTied, ", which the pipeline's last stage shares for the tied head: ",
              "leave it to the first stage's root (units: the blocks)");
  for (const std::string& unit : all) {
    TORCH_CHECK(model_->named_children().contains(unit), "fsdp units: '", unit,
                "' is not a child of the model; units are named as model->named_children() names ",
                "them (a GPT's blocks: h0, h1, ...)");
  }
  std::vector<std::string> mine;
  for (int s = 0; s < stages_; ++s) {
    std::vector<std::string> units;
    for (const auto& c : cut_[static_cast<size_t>(s)]->named_children()) {
      if (std::find(all.begin(), all.end(), c.key()) != all.end()) {
        units.push_back(c.key());
      }
      TORCH_CHECK(s == 0 || c.value()->buffers().empty(), "pipeline stage ", s, "'s layer '",
                  c.key(), "' has buffers, which a mesh checkpoint holds for the first stage only");
    }
    TORCH_CHECK(!units.empty(), "fsdp units: pipeline stage ", s, " holds none of them; give ",
                "units that every stage has (a GPT's blocks, the default)");
    if (s == stage_) {
      mine = units;
    }
  }
  return mine;
}

// The head computes with the embedding's weight, which the last stage keeps as a copy; its
// gradients are summed in fp32 (tied_grad_) whatever dtype the head computes in.
void FsdpPipelineStrategy::hold_tied_copy(const TrainerOptions& o, const torch::Tensor& tied) {
  tied_ = tied;
  if (const auto dtype = o.fsdp().mixed_precision().param_dtype()) {
    // In the units' dtype, as FSDP would gather the root's weights for it in one stage.
    torch::NoGradGuard no_grad;
    tied_.set_data(tied_.to(*dtype));
  }
  // The hook holds the sum, not the strategy: the model (and the hook) may outlive it.
  tied_hook_ = tied_.register_hook([sum = tied_grad_](const torch::Tensor& g) {
    torch::NoGradGuard no_grad;
    if (sum->defined()) {
      sum->add_(g);
    } else {
      *sum = g.to(torch::kFloat, /*non_blocking=*/false, /*copy=*/true);
    }
    return torch::Tensor();
  });
}

// The other stages' weights are dropped (every rank built the whole model), but for the last
// stage's copy of the tied weight.
void FsdpPipelineStrategy::keep_stage() {
  std::set<const void*> kept;
  for (const auto& p : cut_[static_cast<size_t>(stage_)]->parameters()) {
    kept.insert(p.unsafeGetTensorImpl());
  }
  if (tied_.defined()) {
    kept.insert(tied_.unsafeGetTensorImpl());
  }
  torch::NoGradGuard no_grad;
  for (auto& p : model_->parameters()) {
    if (kept.count(p.unsafeGetTensorImpl()) == 0) {
      p.set_data(torch::empty({0}, p.options()));
    }
  }
}

torch::Tensor FsdpPipelineStrategy::forward_backward(const torch::Tensor& input,
                                                     const torch::Tensor& target,
                                                     bool last) {
  trace::Span span("forward and backward (pipeline stage)", "compute");
  // Every rank of a pipeline loads the same batch: the first stage takes the input, the last the
  // target, and each knows the micro-batch count of a last batch smaller than chunks.
  const int64_t chunks = std::min<int64_t>(options_.chunks(), input.size(0));
  fsdp_->set_requires_gradient_sync(last);
  torch::Tensor loss;
  try {
    auto autocast = mp_->autocast();
    loss = pipe_->step(is_first() ? mp_->cast_input(input) : torch::Tensor(),
                       is_last() ? target : torch::Tensor(), chunks);
  } catch (...) {
    clear_tied_gradient();  // the accumulation's sum ends with the failed step
    throw;
  }
  if (tied_.defined()) {
    tied_.mutable_grad() = torch::Tensor();  // the hook's fp32 sum is the one used
  }
  const double accumulate = static_cast<double>(options_.accumulate());
  // Every stage reports the batch's loss, the last stage's.
  torch::Tensor shared =
      is_last() ? (loss * (accumulate / mp_->scaler().get_scale()))
                      .detach()
                      .to(torch::kFloat)
                      .reshape({1})
                : torch::zeros({1}, torch::TensorOptions(device_).dtype(torch::kFloat));
  pp()->broadcast(shared, stages_ - 1)->wait();
  if (last) {
    reduce_tied_gradient();
  }
  return shared[0];
}

int64_t FsdpPipelineStrategy::tied_offset() const {
  const FullyShardedDataParallel::Unit root = fsdp_->units().front();
  const auto at = std::find(root.params.begin(), root.params.end(), kTied) - root.params.begin();
  TORCH_CHECK(at < static_cast<int64_t>(root.params.size()), "the first pipeline stage's root ",
              "unit does not hold ", kTied, ", the weight the head is tied to");
  return root.offsets[static_cast<size_t>(at)];
}

// The tag of the tied weight's messages between the first and the last stage, apart from the
// pipeline's own (0: activations, 1: gradients), whose sends a step waits for before it returns.
constexpr int kTiedTag = 2;

// The last stage's gradient of the tied weight, averaged over its data-parallel ranks, added to
// the first stage's shards of the embedding's. Point to point: the stages between take no part.
void FsdpPipelineStrategy::reduce_tied_gradient() {
  if (!is_first() && !is_last()) {
    return;
  }
  torch::NoGradGuard no_grad;
  torch::Tensor g = torch::zeros(tied_shape_, tied_options_);
  if (is_last()) {
    if (tied_grad_->defined()) {
      g.copy_(*tied_grad_);
    }
    clear_tied_gradient();
    const dist::ProcessGroupPtr& dp = mesh()["dp"];
    if (dp->size() > 1) {
      dp->allreduce(g, dist::ReduceOp::kAvg)->wait();
    }
    pp()->send(g.to(wire()), 0, kTiedTag)->wait();
    return;
  }
  torch::Tensor received = g.to(wire());
  pp()->recv(received, stages_ - 1, kTiedTag)->wait();
  g.copy_(received);
  // This rank's shard is [start, start + per_rank) of the root's flat parameter, the tied
  // weight [offset, offset + numel) of it: their overlap, if any.
  const int64_t offset = tied_offset_;
  const int64_t per_rank = fsdp_->units().front().padded / fsdp_->world_size();
  const int64_t start = per_rank * fsdp_->rank();
  const int64_t lo = std::max(offset, start);
  const int64_t hi = std::min(offset + g.numel(), start + per_rank);
  if (lo >= hi) {
    return;
  }
  torch::Tensor shard = fsdp_->parameters().front();
  torch::Tensor& grad = shard.mutable_grad();
  if (!grad.defined()) {
    grad = torch::zeros_like(shard);
  }
  grad.narrow(0, lo - start, hi - lo)
      .add_(g.reshape({-1}).narrow(0, lo - offset, hi - lo).to(grad.scalar_type()));
}

// The first stage's tied weight, gathered from its root's shards (the embedding's weight is most
// of the root), into the last stage's copy.
void FsdpPipelineStrategy::send_tied_weight() {
  if (!is_first() && !is_last()) {
    return;
  }
  torch::NoGradGuard no_grad;
  torch::Tensor w = torch::empty(tied_shape_, tied_options_.device(wire()));
  if (is_first()) {
    const torch::Tensor shard = fsdp_->parameters().front();
    torch::Tensor whole = torch::empty({shard.numel() * fsdp_->world_size()}, shard.options());
    fsdp_->process_group()->all_gather_into_tensor(whole, shard)->wait();
    w.copy_(whole.narrow(0, tied_offset_, w.numel()).view(tied_shape_));
    pp()->send(w, stages_ - 1, kTiedTag)->wait();
    return;
  }
  pp()->recv(w, 0, kTiedTag)->wait();
  tied_.detach().copy_(w);
}

void FsdpPipelineStrategy::clear_tied_gradient() {
  *tied_grad_ = torch::Tensor();
  if (tied_.defined()) {
    tied_.mutable_grad() = torch::Tensor();  // the hook's sum is the one used
  }
}

// Evaluation runs the batch as one micro-batch; the output is the last stage's.
torch::Tensor FsdpPipelineStrategy::forward(const torch::Tensor& input) {
  torch::Tensor out = pipe_->forward(is_first() ? input : torch::Tensor(), 1);
  if (is_last() && parts_.loss_parallel) {
    out = tensor_parallel_all_gather(out, -1, parts_.tp());
  }
  return out;
}

// Only the last stage has outputs to count: the others take the batch with an empty target.
std::optional<data::Batch> FsdpPipelineStrategy::next_val_batch(data::DataLoader& loader,
                                                                std::optional<data::Batch>& last) {
  std::optional<data::Batch> b =
      next_val_batch_in_step(loader, last, options_.process_group(), device_);
  if (b && !is_last()) {
    b->target = torch::empty({0}, b->target.options());
  }
  return b;
}

// The global norm: each stage's squared norm (over its shards and tensor-parallel parts), summed
// over the stages; clipped with torch.nn.utils.clip_grad_norm_'s coefficient.
double FsdpPipelineStrategy::clip_grad_norm_(double max_norm) {
  const double mine = mesh().has("tp") ? fsdp_->clip_grad_norm_(0, stage_layout_, parts_.tp())
                                       : fsdp_->clip_grad_norm_(0);
  torch::Tensor squares = torch::tensor({mine * mine}, torch::kDouble).to(device_);
  pp()->allreduce(squares)->wait();
  const double total = std::sqrt(squares.cpu().item<double>());
  const double coefficient = max_norm / (total + 1e-6);
  if (max_norm > 0 && coefficient < 1) {
    torch::NoGradGuard no_grad;
    for (auto& p : fsdp_->parameters()) {
      if (p.grad().defined()) {
        p.mutable_grad().mul_(coefficient);
      }
    }
  }
  return total;
}

// Each stage's weights made whole over dp_shard and tp, then sent from its stage to every rank.
TensorMap FsdpPipelineStrategy::weights() {
  std::map<std::string, torch::Tensor> mine = fsdp_->full_state();
  if (mesh().has("tp")) {
    mine = tensor_parallel_full_state(mine, stage_layout_, parts_.tp());
  }
  TensorMap state;
  for (int s = 0; s < stages_; ++s) {
    for (const auto& p : cut_[static_cast<size_t>(s)]->named_parameters()) {
      const auto& [shape, dtype] = whole_.at(p.key());
      torch::Tensor t = s == stage_
                            ? mine.at(p.key()).contiguous()
                            : torch::empty(shape, torch::TensorOptions(device_).dtype(dtype));
      pp()->broadcast(t, s)->wait();
      state[p.key()] = t;
    }
  }
  for (const auto& b : model_->named_buffers()) {
    state[b.key()] = b.value();
  }
  return state;
}

}  // namespace

std::unique_ptr<TrainStrategy> make_fsdp_pipeline(const TrainerOptions& options,
                                                  torch::nn::Sequential model) {
  return std::make_unique<FsdpPipelineStrategy>(options, std::move(model));
}

}  // namespace paratrain::train_internal
