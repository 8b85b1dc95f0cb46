// A FullyShardedDataParallel test worker. Every rank trains a small GPT under FSDP on its own
// batches, and the same GPT as one process would train it on the concatenation of every rank's
// batches. After every optimizer step the gathered FSDP weights (full_state) must equal the
// single process's within the tolerance: 1e-6, or 2e-2 for a bf16 policy.
//
// --steps N (20)  --optimizer adam|sgd  --accumulate K (no_sync on all but the last of K
// micro-batches)  --clip NORM (clip_grad_norm)  --policy none|fp32|bf16 (FsdpMixedPrecision:
// fp32 runs the policy's casts with fp32)  --checkpoint (activation checkpointing)
// --keep-gathered (reshard_after_forward false)  --layers L (3)  --tolerance T (the default above)
// --exact: every parameter bit for bit, the attention's key bias too (see is_key_bias)
// --global-batch B (4 per rank): the sequences of all ranks together, each rank taking B/world;
//   the same B on any number of ranks trains the same model
// Sharded checkpoints (fsdp_checkpoint.h), with the optimizer's state:
// --resume DIR: load DIR before training, continue at the step its metadata names, and train
//   --steps more; the reference trains from step 0 to there first, so that every step is still
//   compared with one process trained without a break
// --save-checkpoint DIR: save after training (metadata "step": the next step)
// --loaded-out FILE, --full-out FILE, --final-out FILE: rank 0 writes full_state() right after
//   --resume loads, right after --save-checkpoint saves, and at the end
// --loaded-optim-out FILE, --optim-out FILE: rank 0 writes the optimizer's state, each tensor
//   laid out as a shard gathered whole and cut to the unit's size (the same on any number of
//   ranks), right after --resume loads and right after --save-checkpoint saves
// --compare-checkpointing: instead, one backward with dropout 0.1 through FSDP with and without
//   activation checkpointing; the shards' gradients must be equal bit for bit.
// Prints "rank R: ok max_diff=D" (exit 0) or "MISMATCH ..." / "error: ..." (exit 1).

#include <paratrain/parallel/fsdp_checkpoint.h>
#include "worker_options.h"

#include <paratrain/paratrain.h>

#include <torch/torch.h>

#include <iostream>
#include <map>

namespace paratrain_test_programs {
namespace fsdp_worker {

namespace pt = paratrain;

namespace {

// Vocabulary and widths that make every unit's flat size uneven over 2 and 3 ranks.
pt::models::GptOptions shape(const Options& o, double dropout) {
  return pt::models::GptOptions()
      .layers(std::stoi(get(o, "--layers", "3")))
      .width(20)
      .heads(2)
      .vocab(37)
      .context(12)
      .dropout(dropout);
}

torch::nn::Sequential make_model(const Options& o, double dropout) {
  torch::manual_seed(5);
  return pt::models::gpt(shape(o, dropout));
}

pt::FsdpOptions fsdp_options(const Options& o, const torch::nn::Sequential& model) {
  pt::FsdpOptions f;
  f.units(pt::models::gpt_block_names(model));
  f.activation_checkpointing(o.count("--checkpoint") > 0);
  f.reshard_after_forward(o.count("--keep-gathered") == 0);
  const std::string policy = get(o, "--policy", "none");
  if (policy == "fp32") {
    f.mixed_precision(pt::FsdpMixedPrecision()
                          .param_dtype(torch::kFloat)
                          .reduce_dtype(torch::kFloat)
                          .output_dtype(torch::kFloat));
  } else if (policy == "bf16") {
    f.mixed_precision(pt::FsdpMixedPrecision()
                          .param_dtype(torch::kBFloat16)
                          .reduce_dtype(torch::kFloat)
                          .output_dtype(torch::kFloat));
  }
  return f;
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const Options& o,
                                                        std::vector<torch::Tensor> params) {
  if (get(o, "--optimizer", "adam") == "sgd") {
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
  }
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
}

// Adam's learning rate: the most its update moves an element per step (0 for SGD, whose step
// is proportional to the gradient and does not magnify rounding).
double learning_rate(const Options& o) {
  return get(o, "--optimizer", "adam") == "sgd" ? 0.0 : 1e-2;
}

torch::Tensor lm_loss(const torch::Tensor& logits, const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(logits.flatten(0, 1), target.flatten());
}

// Every rank's micro-batch `m` of step `s` (`rows` sequences of 12 tokens), stacked by rank.
std::pair<torch::Tensor, torch::Tensor> batch_of_all(int s, int m, int rows) {
  torch::Generator g = at::detail::createCPUGenerator(1000 + 10 * s + m);
  torch::Tensor tokens = torch::randint(0, 37, {rows, 13}, g);
  return {tokens.narrow(1, 0, 12), tokens.narrow(1, 1, 12)};
}

int global_batch(const Options& o, int world) {
  const int rows = std::stoi(get(o, "--global-batch", std::to_string(4 * world)));
  if (rows < world || rows % world != 0) {
    throw std::runtime_error("--global-batch " + std::to_string(rows) + " does not split over " +
                             std::to_string(world) + " ranks");
  }
  return rows;
}

// The attention's key bias (the middle third of c_attn.bias) has a true gradient of zero: softmax
// ignores a shift shared by every key. What reaches it is rounding, which depends on the order
// in which the ranks' gradients were summed; Adam divides a gradient by its own size, so two
// orders move it by up to the learning rate per step in opposite ways. Gloo's reduce-scatter
// sums in rank order, the reference's, so there everything stays bitwise equal (--exact); an
// engine that sums in its own order (MPI's) holds the key bias to Adam's bound instead: at most
// lr per step each way.
bool is_key_bias(const std::string& name) {
  const std::string tail = "attn.c_attn.bias";
  return name.size() >= tail.size() &&
         name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
}

double compare(pt::FullyShardedDataParallel& fsdp,
               const torch::nn::Sequential& ref,
               int step,
               double tolerance,
               double lr) {
  auto full = fsdp.full_state();
  double worst = 0;
  for (const auto& p : ref->named_parameters()) {
    auto it = full.find(p.key());
    if (it == full.end()) {
      throw Mismatch("full_state() has no " + p.key());
    }
    torch::Tensor diff = (it->second - p.value()).abs();
    if (is_key_bias(p.key())) {
      const int64_t w = diff.numel() / 3;
      const double key = diff.narrow(0, w, w).max().item<double>();
      if (!(key <= 2 * lr * (step + 1) + tolerance)) {
        throw Mismatch(p.key() + "'s key part differs by " + std::to_string(key) + " after step " +
                       std::to_string(step));
      }
      diff = torch::cat({diff.narrow(0, 0, w), diff.narrow(0, 2 * w, w)});
    }
    const double d = diff.max().item<double>();
    worst = std::max(worst, d);
    if (!(d <= tolerance)) {
      throw Mismatch(p.key() + " differs by " + std::to_string(d) + " after step " +
                     std::to_string(step));
    }
  }
  return worst;
}

// The single process's gradient of step `s`: the whole batch's, computed as FSDP groups it: each
// rank's share through every micro-batch, then the shares' sum over the world. Summed in the
// ranks' grouping, the gradients of parameters whose true gradient is zero (the attention's key
// bias) get the same rounding as under FSDP, which Adam, dividing a gradient by its own size,
// would otherwise magnify to the learning rate. (Over 3 ranks the engine's own summation order
// still rounds differently: see fsdp_test.cpp.)
void reference_gradients(torch::nn::Sequential ref, int rows, int s, int accumulate, int world) {
  const int mine = rows / world;
  auto params = ref->parameters();
  std::vector<torch::Tensor> total(params.size());
  for (int r = 0; r < world; ++r) {
    for (auto& p : params) {
      p.mutable_grad() = torch::Tensor();
    }
    for (int m = 0; m < accumulate; ++m) {
      auto [x, y] = batch_of_all(s, m, rows);
      (lm_loss(ref->forward(x.narrow(0, r * mine, mine)), y.narrow(0, r * mine, mine)) / accumulate)
          .backward();
    }
    for (size_t i = 0; i < params.size(); ++i) {
      total[i] = r == 0 ? params[i].grad().clone() : total[i] + params[i].grad();
    }
  }
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].mutable_grad() = total[i] / world;
  }
}

// Step `s` of the reference on every rank's batches, and of FSDP on this rank's (unless `fsdp`
// is null: the reference catching up with a resumed job).
void train_step(const Options& o,
                pt::FullyShardedDataParallel* fsdp,
                torch::optim::Optimizer* opt,
                torch::nn::Sequential ref,
                torch::optim::Optimizer& ref_opt,
                int s,
                int world) {
  const int accumulate = std::stoi(get(o, "--accumulate", "1"));
  const double clip = std::stod(get(o, "--clip", "0"));
  const int rows = global_batch(o, world), mine = rows / world;
  if (fsdp != nullptr) {
    opt->zero_grad();
  }
  ref_opt.zero_grad();
  for (int m = 0; m < accumulate; ++m) {
    auto [x, y] = batch_of_all(s, m, rows);
    if (fsdp != nullptr) {
      fsdp->set_requires_gradient_sync(m == accumulate - 1);
      const int64_t at = static_cast<int64_t>(fsdp->rank()) * mine;
      auto out = fsdp->forward(x.narrow(0, at, mine));
      (lm_loss(out, y.narrow(0, at, mine)) / accumulate).backward();
    }
  }
  reference_gradients(ref, rows, s, accumulate, world);
  if (clip > 0) {
    const double b = pt::clip_grad_norm_(ref->parameters(), clip);
    const double a = fsdp != nullptr ? fsdp->clip_grad_norm_(clip) : b;
    if (std::abs(a - b) > 1e-5 * std::max(1.0, b)) {
      throw Mismatch("gradient norms " + std::to_string(a) + " and " + std::to_string(b));
    }
  }
  if (fsdp != nullptr) {
    opt->step();
  }
  ref_opt.step();
}

// full_state() (a collective), written by rank 0.
void write_full_state(pt::FullyShardedDataParallel& fsdp, const std::string& path) {
  auto full = fsdp.full_state();
  if (fsdp.rank() == 0) {
    pt::save_safetensors(full, path);
  }
}

// The optimizer's state as one process would hold it for the flat parameters: the tensors laid out
// as the shards (Adam's moments) all-gathered and cut to each unit's size, the others (Adam's
// step) as they are; written by rank 0. A collective: the keys come in the same order everywhere.
void write_optimizer_state(pt::FullyShardedDataParallel& fsdp,
                           torch::optim::Optimizer& opt,
                           const std::string& path) {
  std::vector<pt::FullyShardedDataParallel::Unit> with_params;
  for (const auto& u : fsdp.units()) {
    if (u.padded > 0) {
      with_params.push_back(u);
    }
  }
  std::map<std::string, torch::Tensor> out;
  for (const auto& [key, t] : pt::optimizer_state(opt)) {
    const auto& unit = with_params.at(std::stoul(key.substr(key.find('.') + 1)));
    if (t.dim() != 1 || t.numel() != unit.padded / fsdp.world_size()) {
      out[key] = t;
      continue;
    }
    torch::Tensor whole = torch::empty({unit.padded}, t.options());
    std::vector<torch::Tensor> parts = whole.chunk(fsdp.world_size());
    fsdp.process_group()->allgather(parts, t.contiguous())->wait();
    out[key] = whole.narrow(0, 0, unit.numel);
  }
  if (fsdp.rank() == 0) {
    pt::save_safetensors(out, path);
  }
}

// --resume: loads the checkpoint and returns the step to continue at.
int resume(const Options& o, pt::FullyShardedDataParallel& fsdp, torch::optim::Optimizer& opt) {
  const auto metadata = pt::load_sharded_checkpoint(get(o, "--resume", ""), fsdp, &opt);
  auto step = metadata.find("step");
  if (step == metadata.end()) {
    throw std::runtime_error("the checkpoint's metadata has no step");
  }
  if (o.count("--loaded-out")) {
    write_full_state(fsdp, get(o, "--loaded-out", ""));
  }
  if (o.count("--loaded-optim-out")) {
    write_optimizer_state(fsdp, opt, get(o, "--loaded-optim-out", ""));
  }
  return std::stoi(step->second);
}

double train_and_compare(const Options& o, const pt::dist::ProcessGroupPtr& pg) {
  const int steps = std::stoi(get(o, "--steps", "20"));
  const bool exact = o.count("--exact") > 0;
  const double tolerance =
      exact ? 0.0
            : std::stod(
                  get(o, "--tolerance", get(o, "--policy", "none") == "bf16" ? "2e-2" : "1e-6"));
  // The key bias's bound (see is_key_bias): none where the sums' order is the reference's.
  const double key_lr = exact ? 0.0 : learning_rate(o);
  auto model = make_model(o, 0.0);
  auto ref = make_model(o, 0.0);
  pt::FullyShardedDataParallel fsdp(model, pg, fsdp_options(o, model));
  auto opt = make_optimizer(o, fsdp.parameters());
  auto ref_opt = make_optimizer(o, ref->parameters());
  double worst = 0;
  int first = 0;
  if (o.count("--resume")) {
    first = resume(o, fsdp, *opt);
    for (int s = 0; s < first; ++s) {
      train_step(o, nullptr, nullptr, ref, *ref_opt, s, pg->size());
    }
    worst = compare(fsdp, ref, first - 1, tolerance, key_lr);
  }
  for (int s = first; s < first + steps; ++s) {
    train_step(o, &fsdp, opt.get(), ref, *ref_opt, s, pg->size());
    worst = std::max(worst, compare(fsdp, ref, s, tolerance, key_lr));
  }
  if (o.count("--save-checkpoint")) {
    pt::save_sharded_checkpoint(get(o, "--save-checkpoint", ""), fsdp, opt.get(),
                                {{"step", std::to_string(first + steps)}});
    if (o.count("--full-out")) {
      write_full_state(fsdp, get(o, "--full-out", ""));
    }
    if (o.count("--optim-out")) {
      write_optimizer_state(fsdp, *opt, get(o, "--optim-out", ""));
    }
  }
  if (o.count("--final-out")) {
    write_full_state(fsdp, get(o, "--final-out", ""));
  }
  return worst;
}

// One backward with dropout through FSDP with and without activation checkpointing, from the
// same RNG state: the shards' gradients must be equal bit for bit.
double compare_checkpointing(const Options& o, const pt::dist::ProcessGroupPtr& pg) {
  std::vector<std::vector<torch::Tensor>> grads;
  for (bool ckpt : {false, true}) {
    auto model = make_model(o, 0.1);
    auto f = fsdp_options(o, model);
    f.activation_checkpointing(ckpt);
    pt::FullyShardedDataParallel fsdp(model, pg, f);
    auto [x, y] = batch_of_all(0, 0, 4 * pg->size());
    torch::manual_seed(77 + pg->rank());
    lm_loss(fsdp.forward(x.narrow(0, pg->rank() * 4, 4)), y.narrow(0, pg->rank() * 4, 4))
        .backward();
    std::vector<torch::Tensor> g;
    for (const auto& p : fsdp.parameters()) {
      g.push_back(p.grad().clone());
    }
    grads.push_back(g);
  }
  for (size_t i = 0; i < grads[0].size(); ++i) {
    if (!torch::equal(grads[0][i], grads[1][i])) {
      throw Mismatch("shard " + std::to_string(i) + "'s gradient differs with checkpointing by " +
                     std::to_string((grads[0][i] - grads[1][i]).abs().max().item<double>()));
    }
  }
  return 0;
}

}  // namespace

int run(int argc, char** argv) {
  const Options opt = parse_options(argc, argv);
  int rank = -1;
  try {
    torch::set_num_threads(1);
    auto pg = pt::dist::init_process_group();
    rank = pg->rank();
    const double worst = opt.count("--compare-checkpointing") ? compare_checkpointing(opt, pg)
                                                              : train_and_compare(opt, pg);
    std::cout << "rank " << rank << ": ok max_diff=" << worst << std::endl;
    return 0;
  } catch (const Mismatch& e) {
    std::cout << "MISMATCH on rank " << rank << ": " << e.what() << std::endl;
  } catch (const c10::Error& e) {
    std::cout << "error: " << e.what_without_backtrace() << std::endl;
  } catch (const std::exception& e) {
    std::cout << "error: " << e.what() << std::endl;
  }
  return 1;
}

}  // namespace fsdp_worker
}  // namespace paratrain_test_programs
