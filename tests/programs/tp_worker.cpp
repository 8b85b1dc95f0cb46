// A tensor-parallel test worker: every rank trains a small GPT on a device mesh (tensor parallel
// over "tp", FSDP over "dp_shard"), and the same GPT as one process would train it on the whole
// batch. After every Adam step the full weights (FSDP's full_state over dp_shard, then the
// tensor-parallel parts all-gathered over tp) must equal the single process's within the
// tolerance, and the parameters that tensor parallelism leaves whole must be bitwise equal on
// every rank of the tp group.
//
// --tp T (world)  --dp-shard S (1)  --dp-replicate R (1: HSDP with S)  --sp (sequence parallel)
// --loss-parallel
// --steps N (20)  --tolerance T (1e-5)  --checkpoint (FSDP's activation checkpointing)
// --optimizer adam|sgd  --lr (1e-3)  --eps (Adam's, 1e-6). Not PyTorch's 1e-8: Adam divides each
//   gradient by its own size, and an element whose gradient is rounding-sized (h1.mlp.c_fc.weight
//   had one of 1.6e-9 at step 0 here) moves by up to lr on rounding alone. Tensor parallelism
//   splits the matmuls' sums, so its rounding differs from one process's by about 1e-10: with
//   eps 1e-8 and lr 1e-2 that element ended 2.2e-4 apart after one step, with eps 1e-6 and lr
//   1e-3 every weight stays within 1e-6 over 20 steps. (SGD, which does not magnify: 1e-7.)
// --dropout P (0): with dropout the single process is not compared (its masks differ); the run
//   must still keep the replicated parameters equal over tp
// --bf16: FSDP's mixed-precision policy (bf16 weights in the units, fp32 gradient reductions
//   and output), against the single process in fp32: the distance between the two runs' weights
//   at the end, relative to how far the single process moved them, must be within --tolerance
// --pp 2: pipeline stages with tensor parallelism inside (see train_pipeline_and_compare)
// --final-out FILE: rank 0 writes the full weights at the end (a run compared with itself)
// Prints "rank R: ok max_diff=D" (exit 0) or "MISMATCH ..." / "error: ..." (exit 1).

#include "worker_options.h"

#include <paratrain/paratrain.h>

#include <torch/torch.h>

#include <cmath>
#include <iostream>
#include <map>
#include <sstream>

namespace paratrain_test_programs {
namespace tp_worker {

namespace pt = paratrain;

namespace {

constexpr int64_t kVocab = 64, kTokens = 16;

torch::nn::Sequential make_model(double dropout) {
  torch::manual_seed(5);
  return pt::models::gpt(
      pt::models::GptOptions().layers(2).width(32).heads(4).vocab(kVocab).context(kTokens).dropout(
          dropout));
}

// Step `s`'s whole batch: `rows` sequences of kTokens tokens and their next tokens.
std::pair<torch::Tensor, torch::Tensor> batch(int s, int rows) {
  torch::Generator g = at::detail::createCPUGenerator(1000 + s);
  torch::Tensor tokens = torch::randint(0, kVocab, {rows, kTokens + 1}, g);
  return {tokens.narrow(1, 0, kTokens), tokens.narrow(1, 1, kTokens)};
}

torch::Tensor lm_loss(const torch::Tensor& logits, const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(logits.flatten(0, 1), target.flatten());
}

double learning_rate(const Options& o) {
  return std::stod(get(o, "--lr", "1e-3"));
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const Options& o,
                                                        std::vector<torch::Tensor> params) {
  if (get(o, "--optimizer", "adam") == "sgd") {
    return std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(learning_rate(o)).momentum(0.9));
  }
  return std::make_unique<torch::optim::Adam>(
      params, torch::optim::AdamOptions(learning_rate(o)).eps(std::stod(get(o, "--eps", "1e-6"))));
}

struct Run {
  pt::DeviceMesh mesh;
  torch::nn::Sequential model;
  pt::TensorParallelLayout layout;
  std::unique_ptr<pt::FullyShardedDataParallel> fsdp;
  std::unique_ptr<torch::optim::Optimizer> opt;
};

std::unique_ptr<Run> make_run(const Options& o, const pt::dist::ProcessGroupPtr& world) {
  const int tp = std::stoi(get(o, "--tp", std::to_string(world->size())));
  const int shard = std::stoi(get(o, "--dp-shard", "1"));
  const int replicate = std::stoi(get(o, "--dp-replicate", "1"));
  auto dims = pt::mesh_dims(world->size(), replicate, shard, tp, 1);
  auto run = std::unique_ptr<Run>(new Run{pt::DeviceMesh(world, dims), {}, {}, nullptr, nullptr});
  run->model = make_model(std::stod(get(o, "--dropout", "0")));
  if (tp > 1) {
    const auto plan =
        pt::models::gpt_parallelize_plan(run->model, tp,
                                         pt::models::GptParallelOptions()
                                             .sequence_parallel(o.count("--sp") > 0)
                                             .loss_parallel(o.count("--loss-parallel") > 0));
    run->layout = pt::parallelize_module(run->model.ptr(), run->mesh["tp"], plan);
  }
  std::vector<torch::Tensor> params = run->model->parameters();
  if (shard > 1) {  // FSDP, or HSDP with dp_replicate
    run->fsdp = std::make_unique<pt::FullyShardedDataParallel>(
        run->model, run->mesh["dp_shard"],
        pt::FsdpOptions()
            .units(pt::models::gpt_block_names(run->model))
            .activation_checkpointing(o.count("--checkpoint") > 0)
            .mixed_precision(o.count("--bf16") ? pt::FsdpMixedPrecision()
                                                     .param_dtype(torch::kBFloat16)
                                                     .reduce_dtype(torch::kFloat)
                                                     .output_dtype(torch::kFloat)
                                               : pt::FsdpMixedPrecision())
            .replicate_group(replicate > 1 ? run->mesh["dp_replicate"] : nullptr));
    params = run->fsdp->parameters();
  }
  run->opt = make_optimizer(o, params);
  return run;
}

// This rank's weights as one process holds them: gathered over dp_shard, then over tp.
std::map<std::string, torch::Tensor> full_weights(Run& run) {
  std::map<std::string, torch::Tensor> local;
  if (run.fsdp) {
    local = run.fsdp->full_state();
  } else {
    for (const auto& p : run.model->named_parameters()) {
      local[p.key()] = p.value().detach();
    }
  }
  if (!run.mesh.has("tp")) {
    return local;
  }
  return pt::tensor_parallel_full_state(local, run.layout, run.mesh["tp"]);
}

// The parameters tensor parallelism leaves whole must stay bitwise equal over the tp group.
void check_replicas(Run& run, const std::map<std::string, torch::Tensor>& full, int step) {
  if (!run.mesh.has("tp")) {
    return;
  }
  const auto& tp = run.mesh["tp"];
  for (const auto& [name, t] : full) {
    if (run.layout.shards.count(name)) {
      continue;
    }
    std::vector<torch::Tensor> all;
    for (int r = 0; r < tp->size(); ++r) {
      all.push_back(torch::empty_like(t, at::MemoryFormat::Contiguous));
    }
    tp->allgather(all, t.contiguous())->wait();
    for (const auto& other : all) {
      if (!torch::equal(other, all[0])) {
        throw Mismatch(name + " differs between tensor-parallel ranks after step " +
                       std::to_string(step));
      }
    }
  }
}

double compare(const std::map<std::string, torch::Tensor>& full,
               const torch::nn::Sequential& ref,
               int step,
               double tolerance) {
  double worst = 0;
  for (const auto& p : ref->named_parameters()) {
    auto it = full.find(p.key());
    if (it == full.end()) {
      throw Mismatch("the mesh's weights have no " + p.key());
    }
    if (!it->second.sizes().equals(p.value().sizes())) {
      throw Mismatch(p.key() + " gathers to a shape other than the model's");
    }
    torch::Tensor diff = (it->second - p.value()).abs();
    const double d = diff.max().item<double>();
    worst = std::max(worst, d);
    if (!(d <= tolerance)) {
      const int64_t at = diff.flatten().argmax().item<int64_t>();
      std::ostringstream why;
      why << p.key() << " differs by " << d << " after step " << step << " at element " << at
          << " (" << it->second.flatten()[at].item<double>() << " against "
          << p.value().flatten()[at].item<double>() << ", whose gradient was "
          << p.value().grad().flatten()[at].item<double>() << ")";
      throw Mismatch(why.str());
    }
  }
  return worst;
}

// bf16 weights round every product to 8 bits of mantissa, so the run cannot follow the fp32 one
// element by element: what must agree is the training, ||w - w_ref|| / ||w_ref - w_0|| over all
// weights (a lost or doubled gradient gives about 1).
double relative_update_difference(const std::map<std::string, torch::Tensor>& full,
                                  const torch::nn::Sequential& ref,
                                  const std::map<std::string, torch::Tensor>& first,
                                  double tolerance) {
  double apart = 0, moved = 0;
  for (const auto& p : ref->named_parameters()) {
    apart += (full.at(p.key()) - p.value()).pow(2).sum().item<double>();
    moved += (p.value() - first.at(p.key())).pow(2).sum().item<double>();
  }
  const double relative = std::sqrt(apart / moved);
  if (!(relative <= tolerance)) {
    throw Mismatch("the weights moved " + std::to_string(std::sqrt(moved)) +
                   " in one process and " + std::to_string(relative) +
                   " of that apart from it on the mesh");
  }
  return relative;
}

void mesh_step(const Options& o, Run& run, int s) {
  const int dp = run.mesh.size("dp"), rows = 4 * dp, mine = rows / dp;
  auto [x, y] = batch(s, rows);
  const int64_t at = static_cast<int64_t>(run.mesh.local_rank("dp")) * mine;
  x = x.narrow(0, at, mine);
  y = y.narrow(0, at, mine);
  run.opt->zero_grad();
  const torch::Tensor out = run.fsdp ? run.fsdp->forward(x) : run.model->forward(x);
  const torch::Tensor loss = o.count("--loss-parallel")
                                 ? pt::loss_parallel_cross_entropy(out, y, run.mesh["tp"])
                                 : lm_loss(out, y);
  loss.backward();
  run.opt->step();
}

double train_and_compare(const Options& o, const pt::dist::ProcessGroupPtr& world) {
  const int steps = std::stoi(get(o, "--steps", "20"));
  const double tolerance = std::stod(get(o, "--tolerance", "1e-5"));
  const bool dropout = std::stod(get(o, "--dropout", "0")) > 0;
  auto run = make_run(o, world);
  auto ref = make_model(0.0);
  auto ref_opt = make_optimizer(o, ref->parameters());
  std::map<std::string, torch::Tensor> first;
  for (const auto& p : ref->named_parameters()) {
    first[p.key()] = p.value().detach().clone();
  }
  torch::manual_seed(11);  // the same dropout masks on every rank of a tp group
  const bool bf16 = o.count("--bf16") > 0;
  double worst = 0;
  std::map<std::string, torch::Tensor> full;
  for (int s = 0; s < steps; ++s) {
    mesh_step(o, *run, s);
    full = full_weights(*run);
    check_replicas(*run, full, s);
    if (!dropout) {
      auto [x, y] = batch(s, 4 * run->mesh.size("dp"));
      ref_opt->zero_grad();
      lm_loss(ref->forward(x), y).backward();
      ref_opt->step();
      if (!bf16) {
        worst = std::max(worst, compare(full, ref, s, tolerance));
      }
    }
  }
  if (bf16) {
    worst = relative_update_difference(full, ref, first, tolerance);
  }
  if (o.count("--final-out") && world->rank() == 0) {
    pt::save_safetensors(full, get(o, "--final-out", ""));
  }
  return worst;
}

// --dump DIR: no training; one forward and backward of step 0's batch on the tensor-parallel
// mesh, and rank 0 writes what PyTorch's DTensor is compared with (tests/parallel/
// dtensor_reference.py): DIR/weights.safetensors (the whole initial weights), DIR/batch
// (input, target), DIR/logits (whole) and DIR/grads (the whole gradients).
void dump_for_pytorch(const Options& o, const pt::dist::ProcessGroupPtr& world) {
  for (const char* other : {"--pp", "--dp-shard", "--dp-replicate", "--sp", "--loss-parallel"}) {
    TORCH_CHECK(!o.count(other), "--dump compares plain tensor parallelism (--tp); drop ", other);
  }
  auto run = make_run(o, world);
  const std::string dir = get(o, "--dump", "");
  std::map<std::string, torch::Tensor> weights = full_weights(*run);
  auto [x, y] = batch(0, 4);
  const torch::Tensor logits = run->model->forward(x);
  lm_loss(logits, y).backward();
  std::map<std::string, torch::Tensor> grads;
  for (const auto& p : run->model->named_parameters()) {
    grads[p.key()] = p.value().grad();
  }
  grads = pt::tensor_parallel_full_state(grads, run->layout, run->mesh["tp"]);
  if (world->rank() == 0) {
    pt::save_safetensors(weights, dir + "/weights.safetensors");
    pt::save_safetensors({{"input", x}, {"target", y}}, dir + "/batch.safetensors");
    pt::save_safetensors({{"logits", logits.detach()}}, dir + "/logits.safetensors");
    pt::save_safetensors(grads, dir + "/grads.safetensors");
  }
  world->barrier()->wait();
}

// --pp P: pipeline stages over "pp" with tensor parallelism inside each stage (3-D without data
// parallelism). Every rank builds and parallelizes the whole model, then keeps its stage. The
// head's weight is the embedding's (tied): the last stage steps its own copy of it, and the first
// and last stages sum the copies' gradients, as Megatron-LM's embedding group does, so that both
// copies stay equal. Each rank compares its stage's weights (gathered over tp) with one process.
double train_pipeline_and_compare(const Options& o, const pt::dist::ProcessGroupPtr& world) {
  const int pp = std::stoi(get(o, "--pp", "1"));
  const int tp = std::stoi(get(o, "--tp", "1"));
  const int steps = std::stoi(get(o, "--steps", "20"));
  const double tolerance = std::stod(get(o, "--tolerance", "1e-5"));
  const bool lp = o.count("--loss-parallel") > 0;
  pt::DeviceMesh mesh(world, pt::mesh_dims(world->size(), 1, 1, tp, pp));
  auto model = make_model(0.0);
  auto ref = make_model(0.0);
  pt::TensorParallelLayout layout;
  if (tp > 1) {
    layout =
        pt::parallelize_module(model.ptr(), mesh["tp"],
                               pt::models::gpt_parallelize_plan(
                                   model, tp, pt::models::GptParallelOptions().loss_parallel(lp)));
  }
  const torch::Tensor wte = model->named_parameters()["embed.wte.weight"];
  const int stage = mesh.local_rank("pp");
  if (pp != 2) {
    throw std::runtime_error("this worker splits the GPT into 2 stages (--pp 2)");
  }
  auto mine =
      pt::pipeline::split(model, {2, 3})[static_cast<size_t>(stage)];  // embed,h0 | h1,ln_f,head
  model = nullptr;
  const pt::dist::ProcessGroupPtr tp_group = tp > 1 ? mesh["tp"] : nullptr;
  pt::pipeline::LossFn loss = [lp, tp_group](const torch::Tensor& out, const torch::Tensor& y) {
    return lp ? pt::loss_parallel_cross_entropy(out, y, tp_group) : lm_loss(out, y);
  };
  pt::pipeline::DistributedPipeline pipe(mine, stage, mesh["pp"], {0, 1}, torch::kCPU, loss,
                                         pt::pipeline::PipelineOptions().chunks(2));
  std::vector<torch::Tensor> params = mine->parameters();
  if (pipe.is_last()) {
    params.push_back(wte);  // the tied head's weight: not among the last stage's own parameters
  }
  auto opt = make_optimizer(o, params);
  auto ref_opt = make_optimizer(o, ref->parameters());
  double worst = 0;
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = batch(s, 4);
    opt->zero_grad();
    pipe.step(pipe.is_first() ? x : torch::Tensor(), pipe.is_last() ? y : torch::Tensor());
    // The tied weight's two copies: the embedding's gradient plus the head's.
    torch::Tensor g = wte.grad().defined() ? wte.grad() : torch::zeros_like(wte);
    mesh["pp"]->allreduce(g)->wait();
    wte.mutable_grad() = g;
    opt->step();
    ref_opt->zero_grad();
    lm_loss(ref->forward(x), y).backward();
    ref_opt->step();
    std::map<std::string, torch::Tensor> local;
    for (const auto& p : mine->named_parameters()) {
      local[p.key()] = p.value().detach();
    }
    local["embed.wte.weight"] = wte.detach();
    auto full = tp > 1 ? pt::tensor_parallel_full_state(local, layout, mesh["tp"]) : local;
    std::map<std::string, torch::Tensor> wanted;
    for (const auto& p : ref->named_parameters()) {
      if (full.count(p.key())) {
        wanted[p.key()] = p.value();
      }
    }
    for (const auto& [name, want] : wanted) {
      const double d = (full.at(name) - want).abs().max().item<double>();
      worst = std::max(worst, d);
      if (!(d <= tolerance)) {
        throw Mismatch(name + " differs by " + std::to_string(d) + " after step " +
                       std::to_string(s) + " on stage " + std::to_string(stage));
      }
    }
  }
  return worst;
}

}  // namespace

int run(int argc, char** argv) {
  const Options opt = parse_options(argc, argv);
  int rank = -1;
  try {
    torch::set_num_threads(1);
    auto pg = pt::dist::init_process_group();
    rank = pg->rank();
    double worst = 0;
    if (opt.count("--dump")) {
      dump_for_pytorch(opt, pg);
    } else {
      worst = opt.count("--pp") ? train_pipeline_and_compare(opt, pg) : train_and_compare(opt, pg);
    }
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

}  // namespace tp_worker
}  // namespace paratrain_test_programs
