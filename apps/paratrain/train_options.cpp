// paratrain train's option table, and the checks of its command line that run before anything is
// loaded or launched.

#include "train_options.h"

#include "paratrain/base/option_error.h"
#include "paratrain/models/gpt_pretrained.h"

#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

namespace paratrain {
namespace cli {
namespace train_detail {

namespace {

// What is trained, on what, and how it is spread over processes and devices.
std::vector<OptionSpec> setup_option_specs() {
  return {
      {"model", "NAME",
       "linear, mlp, cnn, resnet18..152, resnet*_cifar, gpt2, gpt2-medium, gpt2-large, gpt2-xl "
       "or gpt (default mlp)"},
      {"dataset", "NAME", "fashion-mnist (default), imagefolder, or tokens (for the GPTs)"},
      {"data-dir", "DIR",
       "the dataset's folder; an ImageFolder has DIR/train and DIR/val, tokens DIR/train.bin and "
       "DIR/val.bin (default: Debian's Fashion-MNIST)"},
      {"layers", "L", "--model gpt: transformer blocks (required)"},
      {"width", "D", "--model gpt: the embedding width, n_embd (required)"},
      {"heads", "H", "--model gpt: attention heads, a divisor of --width (required)"},
      {"vocab", "V", "GPT: the vocabulary size (default 50257, GPT-2's; 256 for byte tokens)"},
      {"context", "N",
       "GPT: tokens per sample, the model's context (default 1024; at most a preset's 1024)"},
      {"strategy", "NAME",
       "single (default), ddp, fsdp, dp or pipeline (fsdp when a mesh degree below is given)"},
      {"dp-replicate", "R",
       "fsdp: replicas of the sharded model (HSDP), torchtitan's data_parallel_replicate_degree "
       "(default 1)"},
      {"dp-shard", "S",
       "fsdp: ranks each replica is sharded over, torchtitan's data_parallel_shard_degree "
       "(default -1: what the other degrees leave of the world)"},
      {"tp", "T",
       "fsdp with a GPT: tensor-parallel ranks, adjacent ones, with sequence and loss parallel "
       "(default 1)"},
      {"pp", "P",
       "fsdp with a GPT: pipeline stages, outermost, each sharded and split as above, with "
       "--chunks and --schedule (default 1)"},
      {"no-sequence-parallel", "",
       "with --tp: keep the LayerNorms and the residual stream whole on every rank"},
      {"no-loss-parallel", "", "with --tp: gather the logits over the vocabulary before the loss"},
      {"nproc-per-node,nproc_per_node,nproc", "N",
       "with ddp or fsdp: start N ranks through the launcher, as torchrun --nproc-per-node "
       "(--nproc: the earlier spelling, kept for this release)"},
      {"backend", "NAME", "ddp's backend: auto (default), gloo, mpi or nccl"},
      {"max-restarts", "N",
       "with --nproc-per-node: when a rank fails, stop every rank and start them all again, up to "
       "N "
       "times (torchrun's); add --resume auto to continue from the last checkpoint"},
      {"device", "KIND",
       "single and ddp: cuda (cuda:LOCAL_RANK, the default where CUDA is available) or cpu"},
      {"devices", "LIST",
       "dp: the devices the batch is scattered over; pipeline: one per stage (cpu,cpu)"},
      {"stages", "P", "pipeline stages (default 2)"},
      {"chunks", "M", "pipeline and --pp: micro-batches per batch (default 4)"},
      {"schedule", "NAME", "pipeline and --pp: the schedule, gpipe (default) or 1f1b"},
      {"epochs", "E", "epochs (default 1)"},
      {"steps", "S", "cap on the steps of each epoch (default 0: the whole epoch)"},
      {"batch-size", "B",
       "per rank (ddp), or the whole batch (dp scatters it, pipeline cuts it) (default 64)"},
      {"workers", "K", "decoding threads; 0 decodes in the training thread (default 1)"},
      {"image-size", "N", "the model's input side (default: the model's own)"},
      {"channels", "C", "1 or 3 input channels (default: the model's own)"},
      {"head", "custom", "replace the classifier by a Linear-BN-ReLU-Dropout head"},
      {"freeze-backbone", "", "with --head custom: train the head only"},
  };
}

// How the training loop runs, and what it writes.
std::vector<OptionSpec> loop_option_specs() {
  return {
      {"amp", "LEVEL", "mixed precision O0 (default), O1, O2 or O3"},
      {"amp-dtype", "TYPE", "with --amp: bf16 (default) or fp16"},
      {"optimizer", "NAME", "sgd (default), adam or adamw"},
      {"fused-optimizer", "",
       "the optimizer's step in one vectorized pass per CPU parameter, as PyTorch's "
       "Adam(fused=True)"},
      {"lr", "L", "learning rate (default 0.05)"},
      {"momentum", "M", "SGD momentum (default 0.9)"},
      {"weight-decay", "W", "weight decay (default 0)"},
      {"lr-schedule", "NAME",
       "constant (default), step, multistep or cosine, with PyTorch's StepLR, MultiStepLR and "
       "CosineAnnealingLR semantics"},
      {"lr-step-size", "N", "step: decay every N epochs (default 30)"},
      {"lr-gamma", "G", "step, multistep: the decay factor (default 0.1)"},
      {"lr-milestones", "A,B", "multistep: the epochs where the lr decays"},
      {"lr-t-max", "T", "cosine: T_max (default: the epochs after the warm-up)"},
      {"lr-eta-min", "E", "cosine: the lowest lr (default 0)"},
      {"warmup", "N", "LinearLR warm-up over N epochs (or steps), before the schedule"},
      {"warmup-start-factor", "F", "the warm-up's first factor (default 1/3)"},
      {"schedule-per-step", "", "step the schedule per optimizer step, not per epoch"},
      {"clip-grad-norm", "X", "clip the gradients' global norm to X (0: off)"},
      {"accumulate", "K", "accumulate gradients over K batches per optimizer step"},
      {"seed", "S", "the seed of the weights, the shuffling and the augmentations (default 0)"},
      {"checkpoint-dir", "DIR", "write checkpoints there (per epoch unless --checkpoint-every)"},
      {"checkpoint-every", "N", "a checkpoint every N optimizer steps"},
      {"checkpoint-every-epoch", "", "a checkpoint at every epoch's end"},
      {"keep", "K", "keep the newest K checkpoints (default 3)"},
      {"resume", "auto|PATH",
       "continue from the newest checkpoint that verifies (auto) or from PATH (ckpt-N.json)"},
      {"start-fresh-if-damaged", "",
       "with --resume auto: when every checkpoint in --checkpoint-dir is damaged, start from "
       "step 0 beside them (kept, never rotated away) instead of failing"},
      {"resume-may-change", "LIST",
       "settings that may differ from the checkpoint's on resume, as lr,momentum (population-"
       "based training perturbs them)"},
      {"metrics", "FILE", "write loss, accuracy, lr, images/s, grad norm, loss scale as JSONL"},
      {"tensorboard", "DIR", "write the same metrics as TensorBoard event files into DIR"},
      {"log-every", "N", "a metrics row every N steps (default 10 with --metrics)"},
      {"check-replicas", "N",
       "every N steps, compare the ranks' parameters and name a diverged one"},
      {"trace", "FILE", "write a Chrome trace of every rank (Perfetto, chrome://tracing)"},
      {"sync-bn", "", "ddp: BatchNorm over the whole batch of all ranks (SyncBatchNorm)"},
      {"zero", "", "ddp: shard the optimizer state over the ranks (ZeroRedundancyOptimizer)"},
      {"offload", "LIST",
       "fsdp (ddp with --zero: optimizer only): keep the optimizer's moments, the gradients and "
       "the shards (optimizer,gradients,params, or all) in files in --offload-dir, or in host "
       "memory with host (ZeRO-Offload, ZeRO-Infinity); adam and adamw, fused; with --device "
       "cuda, optimizer alone (Adam on the CPU)"},
      {"offload-dir", "DIR",
       "with --offload: a directory on a disk (not tmpfs) for each rank's offloaded state, "
       "checked for room before training"},
      {"checkpoint-activations", "",
       "fsdp: recompute each unit's activations in backward instead of keeping them"},
      {"fsdp-param-dtype", "bf16|fp16",
       "fsdp: gather the weights in this dtype (FSDP's MixedPrecisionPolicy; fp32 shards)"},
      {"zero-checkpoint", "consolidated|sharded",
       "with --zero: checkpoints hold the optimizer state gathered on rank 0 (default) or "
       "each rank's shard"},
      {"save-weights", "FILE", "write the trained weights as safetensors"},
      {"load-weights", "FILE|DIR",
       "start from these weights: safetensors or torch.save files, or a Hugging Face GPT-2 "
       "directory (config.json gives the shape; --context may shorten it)"},
      {"json", "", "print each epoch as a JSON object"},
  };
}

// The help lists them in this order.
std::vector<OptionSpec> train_option_specs() {
  std::vector<OptionSpec> options = setup_option_specs();
  const std::vector<OptionSpec> loop = loop_option_specs();
  options.insert(options.end(), loop.begin(), loop.end());
  return options;
}

// "cpu,cpu" or "cuda:0,cuda:1": each must parse and exist.
std::vector<torch::Device> parse_devices(const std::string& list) {
  std::vector<torch::Device> out;
  std::stringstream in(list);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (item.empty()) {
      continue;
    }
    try {
      out.emplace_back(item);
    } catch (const c10::Error&) {
      throw UsageError("bad device '" + item + "' in --devices: write cpu or cuda:N");
    }
    try {
      check_device_exists(out.back());
    } catch (const c10::Error& e) {
      throw UsageError(std::string("--devices: ") + e.what_without_backtrace());
    }
  }
  if (out.empty()) {
    throw UsageError("--devices is empty: name at least one device, e.g. cpu,cpu");
  }
  return out;
}

// Every value is read before any is checked, so a malformed number is reported first.
TrainSettings read_basics(const Args& args) {
  TrainSettings s;
  s.model_name = args.get("model", "mlp");
  s.dataset = args.get("dataset", "fashion-mnist");
  const bool mesh =
      args.has("dp-replicate") || args.has("dp-shard") || args.has("tp") || args.has("pp");
  s.strategy = args.get("strategy", mesh ? "fsdp" : "single");
  s.epochs = args.get_int("epochs", 1);
  s.steps = args.get_int("steps", 0);
  s.batch_size = args.get_int("batch-size", 64);
  s.lr = args.get_double("lr", 0.05);
  s.momentum = args.get_double("momentum", 0.9);
  s.weight_decay = args.get_double("weight-decay", 0.0);
  s.seed = args.get_int("seed", 0);
  s.workers = args.get_int("workers", 1);
  s.nproc = args.get_int("nproc-per-node", 0);
  s.json = args.has("json");
  s.data_dir = args.get("data-dir", data::kFashionMnistDir);
  return s;
}

// The registry's models, then the GPT-2 presets and "gpt" (once each, whichever lists them).
std::vector<std::string> model_names() {
  std::vector<std::string> known = models::names();
  std::vector<std::string> gpts = models::gpt_presets();
  gpts.push_back("gpt");
  for (const auto& name : gpts) {
    if (std::find(known.begin(), known.end(), name) == known.end()) {
      known.push_back(name);
    }
  }
  return known;
}

}  // namespace

bool is_gpt(const std::string& name) {
  const auto presets = models::gpt_presets();
  return name == "gpt" || std::find(presets.begin(), presets.end(), name) != presets.end();
}

namespace {

// A Hugging Face model directory's shape (config.json), with --context shortening it.
models::GptOptions read_hf_gpt(const Args& args, const std::string& dir) {
  for (const char* flag : {"layers", "width", "heads", "vocab"}) {
    if (args.has(flag)) {
      throw UsageError(std::string("--") + flag + " shapes a GPT built from scratch; with " +
                       "--load-weights " + dir + " (a Hugging Face model directory) the shape is " +
                       "its config.json's: drop --" + flag);
    }
  }
  models::GptOptions o = models::gpt2_config_options(dir);
  const int64_t context = args.get_int("context", static_cast<int>(o.context()));
  if (context < 1 || context > o.context()) {
    throw UsageError("--context " + std::to_string(context) + " does not fit " + dir +
                     "'s n_positions of " + std::to_string(o.context()) +
                     " (its position embeddings): give 1 to " + std::to_string(o.context()));
  }
  return o.context(context);
}

}  // namespace

models::GptOptions read_gpt(const Args& args, const std::string& name) {
  for (const char* flag : {"image-size", "channels", "head", "freeze-backbone"}) {
    if (args.has(flag)) {
      throw UsageError(std::string("--") + flag + " goes with the image models; --model " + name +
                       " is a GPT");
    }
  }
  if (args.has("load-weights") && std::filesystem::is_directory(args.get("load-weights"))) {
    return read_hf_gpt(args, args.get("load-weights"));
  }
  models::GptOptions o;
  if (name == "gpt") {
    if (!args.has("layers") || !args.has("width") || !args.has("heads")) {
      throw UsageError(
          "--model gpt needs its shape: --layers L --width D --heads H (or a preset: "
          "--model gpt2)");
    }
    o.layers(args.get_int("layers", 0)).width(args.get_int("width", 0));
    o.heads(args.get_int("heads", 0));
  } else {
    if (args.has("layers") || args.has("width") || args.has("heads")) {
      throw UsageError("--layers, --width and --heads shape --model gpt; " + name +
                       " has its own: drop them, or use --model gpt");
    }
    o = models::gpt_options(name);
  }
  o.vocab(args.get_int("vocab", static_cast<int>(o.vocab())));
  const int64_t context = args.get_int("context", static_cast<int>(o.context()));
  if (name != "gpt" && context > o.context()) {
    throw UsageError("--context " + std::to_string(context) + " is longer than " + name +
                     "'s context of " + std::to_string(o.context()) +
                     " (its position embeddings): give at most that");
  }
  o.context(context);
  if (o.layers() < 1 || o.width() < 1 || o.heads() < 1 || o.vocab() < 1 || o.context() < 1) {
    throw UsageError("--layers, --width, --heads, --vocab and --context must be >= 1");
  }
  if (o.width() % o.heads() != 0) {
    throw UsageError("--width " + std::to_string(o.width()) + " is not a multiple of --heads " +
                     std::to_string(o.heads()) + ": each head takes width / heads channels");
  }
  return o;
}

namespace {

// The model, the input it is fed and its head.
void check_model(const Args& args, TrainSettings& s) {
  {
    const auto known = model_names();
    if (std::find(known.begin(), known.end(), s.model_name) == known.end()) {
      std::string list;
      for (const auto& n : known) {
        list += (list.empty() ? "" : ", ") + n;
      }
      throw UsageError("unknown --model '" + s.model_name + "': choose " + list);
    }
  }
  s.gpt = is_gpt(s.model_name);
  if (s.gpt) {
    s.gpt_options = read_gpt(args, s.model_name);
    return;
  }
  for (const char* flag : {"layers", "width", "heads", "vocab", "context"}) {
    if (args.has(flag)) {
      throw UsageError(std::string("--") + flag + " goes with --model gpt or a GPT-2 preset (got " +
                       "--model " + s.model_name + ")");
    }
  }
  const std::vector<int64_t> expects = models::input_shape(s.model_name);
  s.image_size = args.get_int("image-size", static_cast<int>(expects[1]));
  s.channels = args.get_int("channels", static_cast<int>(expects[0]));
  if (s.image_size < 1 || (s.channels != 1 && s.channels != 3)) {
    throw UsageError("--image-size must be >= 1 and --channels 1 or 3");
  }
  s.head = args.get("head", "");
  if (!s.head.empty() && s.head != "custom") {
    throw UsageError("unknown --head '" + s.head +
                     "': the one head is 'custom' (a "
                     "Linear-BN-ReLU-Dropout classifier)");
  }
  if (args.has("freeze-backbone") && s.head.empty()) {
    throw UsageError("--freeze-backbone goes with --head custom");
  }
}

// The dataset, the strategy, and the flags that only some strategies take.
void check_data_and_strategy(const Args& args, TrainSettings& s) {
  if (s.dataset != "fashion-mnist" && s.dataset != "imagefolder" && s.dataset != "tokens") {
    throw UsageError("unknown --dataset '" + s.dataset +
                     "': choose fashion-mnist, imagefolder or tokens");
  }
  if (s.dataset == "imagefolder" && !args.has("data-dir")) {
    throw UsageError("--dataset imagefolder needs --data-dir D (with D/train and D/val)");
  }
  if (s.dataset == "tokens" && !s.gpt) {
    throw UsageError(
        "--dataset tokens trains a language model: choose --model gpt2 (or "
        "gpt2-medium, gpt2-large, gpt2-xl) or --model gpt (got --model " +
        s.model_name + ")");
  }
  if (s.gpt && s.dataset != "tokens") {
    throw UsageError("--model " + s.model_name +
                     " is a language model: train it on token files with --dataset tokens "
                     "--data-dir D (got --dataset " +
                     s.dataset + ")");
  }
  if (s.dataset == "tokens" && !args.has("data-dir")) {
    throw UsageError(
        "--dataset tokens needs --data-dir D (with D/train.bin and D/val.bin, as "
        "`paratrain data tokenize` writes them)");
  }
  const std::string& strategy = s.strategy;
  try {
    parse_strategy(strategy);
  } catch (const OptionError& e) {
    throw UsageError(flag_message(e));
  }
  for (const char* flag :
       {"checkpoint-activations", "fsdp-param-dtype", "dp-replicate", "dp-shard", "tp", "pp"}) {
    if (args.has(flag) && strategy != "fsdp") {
      throw UsageError(std::string("--") + flag + " goes with --strategy fsdp (got --strategy " +
                       strategy + ")");
    }
  }
  for (const char* flag : {"no-sequence-parallel", "no-loss-parallel"}) {
    if (args.has(flag) && args.get_int("tp", 1) <= 1) {
      throw UsageError(std::string("--") + flag + " goes with --tp T (T above 1)");
    }
  }
  if (args.get_int("pp", 1) > 1 && !s.gpt) {
    throw UsageError(
        "--pp cuts a GPT between its blocks: use --model gpt or a GPT-2 preset (got --model " +
        s.model_name + ")");
  }
  if (args.get_int("tp", 1) > 1 && !s.gpt) {
    throw UsageError(
        "--tp splits a GPT's heads, MLP and vocabulary: use --model gpt or a GPT-2 "
        "preset (got --model " +
        s.model_name + ")");
  }
  if (args.has("fsdp-param-dtype") && args.get("fsdp-param-dtype") != "bf16" &&
      args.get("fsdp-param-dtype") != "fp16") {
    throw UsageError("unknown --fsdp-param-dtype '" + args.get("fsdp-param-dtype") +
                     "': choose bf16 or fp16");
  }
  if (args.has("devices") && strategy != "dp" && strategy != "pipeline") {
    throw UsageError("--devices goes with --strategy dp or pipeline");
  }
  if (strategy == "dp" && args.has("devices")) {
    s.dp_devices = parse_devices(args.get("devices"));
  }
}

amp::AmpOptions read_amp(const Args& args) {
  amp::AmpOptions amp_options;
  if (args.has("amp-dtype") && !args.has("amp")) {
    throw UsageError("--amp-dtype goes with --amp O1|O2|O3");
  }
  if (args.has("amp")) {
    try {
      amp_options.opt_level(amp::parse_opt_level(args.get("amp")));
      if (args.has("amp-dtype")) {
        amp_options.dtype(amp::parse_dtype(args.get("amp-dtype")));
      }
    } catch (const c10::Error& e) {
      throw UsageError(e.what_without_backtrace());
    }
  }
  return amp_options;
}

// --stages, --chunks, --schedule and the stages' --devices; --pp's stages take --chunks and
// --schedule too (torchtitan's microbatches and schedule).
void read_pipeline(const Args& args, TrainSettings& s) {
  s.piped = s.strategy == "pipeline";
  const bool mesh_stages = args.get_int("pp", 1) > 1;
  if (!s.piped && args.has("stages")) {
    throw UsageError("--stages goes with --strategy pipeline (on a mesh: --pp P)");
  }
  if (!s.piped && !mesh_stages && (args.has("chunks") || args.has("schedule"))) {
    throw UsageError("--chunks and --schedule go with --strategy pipeline or --pp P (P above 1)");
  }
  s.stages = args.get_int("stages", 2);
  s.chunks = args.get_int("chunks", 4);
  if (!s.piped && !mesh_stages) {
    return;
  }
  if (s.stages < 1) {
    throw UsageError("--stages must be >= 1, got " + std::to_string(s.stages));
  }
  if (s.chunks < 1) {
    throw UsageError("--chunks must be >= 1, got " + std::to_string(s.chunks));
  }
  try {
    s.schedule = pipeline::parse_schedule(args.get("schedule", "gpipe"));
  } catch (const c10::Error& e) {
    throw UsageError(e.what_without_backtrace());
  }
  if (!s.piped) {
    return;
  }
  s.stage_devices = args.has("devices")
                        ? parse_devices(args.get("devices"))
                        : std::vector<torch::Device>(static_cast<size_t>(s.stages), torch::kCPU);
  if (s.stage_devices.size() != static_cast<size_t>(s.stages)) {
    throw UsageError("--devices names " + std::to_string(s.stage_devices.size()) + " devices for " +
                     std::to_string(s.stages) + " stages; give one per stage");
  }
}

void check_counts(const TrainSettings& s) {
  if (s.steps < 0 || s.lr <= 0 || s.momentum < 0 || s.weight_decay < 0) {
    throw UsageError("--steps, --momentum and --weight-decay must be >= 0, --lr > 0");
  }
  if (s.nproc < 0 || (s.nproc > 0 && s.strategy != "ddp" && s.strategy != "fsdp")) {
    throw UsageError("--nproc-per-node needs --strategy ddp or fsdp and a positive count");
  }
}

// --device, checked against the GPUs there are (the ranks a launcher would start included).
std::string read_device_kind(const Args& args, const TrainSettings& s) {
  const std::string device_kind = args.get("device", torch::cuda::is_available() ? "cuda" : "cpu");
  if (device_kind != "cpu" && device_kind != "cuda") {
    throw UsageError("unknown --device '" + device_kind + "': choose cpu or cuda");
  }
  if (args.has("device") && (s.strategy == "dp" || s.strategy == "pipeline")) {
    throw UsageError(
        "--device goes with --strategy single, ddp or fsdp; dp and pipeline take --devices");
  }
  if (device_kind == "cuda") {
    try {
      check_device_exists(torch::Device(torch::kCUDA));
      if (becomes_launcher(s)) {
        dist::check_ranks_fit_gpus(s.nproc, static_cast<int>(torch::cuda::device_count()));
      }
    } catch (const c10::Error& e) {
      throw UsageError(e.what_without_backtrace());
    }
  }
  return device_kind;
}

OptimizerOptions optimizer_options(const Args& args) {
  const OptimizerOptions opt = OptimizerOptions()
                                   .kind(args.get("optimizer", "sgd"))
                                   .lr(args.get_double("lr", 0.05))
                                   .momentum(args.get_double("momentum", 0.9))
                                   .weight_decay(args.get_double("weight-decay", 0.0))
                                   .fused(args.has("fused-optimizer"));
  const std::string& kind = opt.kind();
  if (kind != "sgd" && kind != "adam" && kind != "adamw") {
    throw UsageError("unknown --optimizer '" + kind + "': choose sgd, adam or adamw");
  }
  return opt;
}

std::vector<int64_t> parse_milestones(const std::string& text) {
  std::vector<int64_t> milestones;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    try {
      size_t used = 0;
      milestones.push_back(std::stoll(item, &used));
      if (used != item.size()) {
        throw std::invalid_argument(item);
      }
    } catch (const std::exception&) {
      throw UsageError("bad --lr-milestones entry '" + item + "': give numbers like 30,60,80");
    }
  }
  return milestones;
}

LRScheduleOptions lr_schedule_options(const Args& args, int epochs) {
  LRScheduleOptions ls;
  ls.kind(args.get("lr-schedule", "constant"))
      .step_size(args.get_int("lr-step-size", 30))
      .gamma(args.get_double("lr-gamma", 0.1))
      .eta_min(args.get_double("lr-eta-min", 0.0))
      .warmup(args.get_int("warmup", 0))
      .warmup_start_factor(args.get_double("warmup-start-factor", 1.0 / 3.0));
  ls.milestones(parse_milestones(args.get("lr-milestones", "")));
  // CosineAnnealingLR's T_max: by default the whole run after the warm-up, in epochs; stepped per
  // optimizer step it must be given in steps.
  if (ls.kind() == "cosine" && args.has("schedule-per-step") && !args.has("lr-t-max")) {
    throw UsageError("--lr-schedule cosine with --schedule-per-step needs --lr-t-max in steps");
  }
  ls.t_max(args.get_int("lr-t-max", std::max(1, epochs - static_cast<int>(ls.warmup()))));
  try {
    check_lr_schedule(ls);
  } catch (const c10::Error& e) {
    throw UsageError(std::string("--lr-schedule: ") + e.what_without_backtrace());
  }
  return ls;
}

// --offload's parts and tier, and --offload-dir.
TrainOffloadOptions read_offload(const Args& args) {
  TrainOffloadOptions off;
  if (!args.has("offload")) {
    if (args.has("offload-dir")) {
      throw UsageError(
          "--offload-dir says where --offload keeps state: add --offload optimizer "
          "(or optimizer,gradients,params)");
    }
    return off;
  }
  bool host = false;
  for (const std::string& part : split_list(args.get("offload"))) {
    if (part == "optimizer" || part == "all") {
      off.optimizer(true);
    }
    if (part == "gradients" || part == "all") {
      off.gradients(true);
    }
    if (part == "params" || part == "all") {
      off.params(true);
    }
    host = host || part == "host";
    if (part != "optimizer" && part != "gradients" && part != "params" && part != "all" &&
        part != "host") {
      throw UsageError("unknown --offload part '" + part +
                       "': choose optimizer, gradients, params, all, and host for host memory");
    }
  }
  if (!off.any()) {
    off.optimizer(true);  // --offload host: the optimizer's state in host memory
  }
  if (host == args.has("offload-dir")) {
    throw UsageError(host ? "--offload host keeps the state in host memory and --offload-dir in "
                            "files: give one of them"
                          : "--offload needs --offload-dir DIR (a directory on a disk), or host "
                            "in its list to keep the state in host memory");
  }
  return off.dir(host ? "" : args.get("offload-dir"));
}

// The checkpoint, metrics, replica-check, trace and ZeRO flags, as given.
void read_outputs(const Args& args, TrainerOptions& o) {
  o.checkpoint_dir(args.get("checkpoint-dir", ""))
      .checkpoint_every(args.get_int("checkpoint-every", 0))
      .checkpoint_every_epoch(args.has("checkpoint-every-epoch"))
      .keep(args.get_int("keep", 3))
      .resume(args.get("resume", ""))
      .start_fresh_if_damaged(args.has("start-fresh-if-damaged"))
      .resume_may_change(split_list(args.get("resume-may-change", "")))
      .metrics(args.get("metrics", ""))
      .tensorboard(args.get("tensorboard", ""))
      .log_every(args.get_int("log-every", args.has("metrics") || args.has("tensorboard") ? 10 : 0))
      .check_replicas(args.get_int("check-replicas", 0))
      .trace(args.get("trace", ""))
      .sync_batchnorm(args.has("sync-bn"))
      .zero(args.has("zero"))
      .zero_checkpoint(args.get("zero-checkpoint", "consolidated"))
      .offload(read_offload(args));
}

// The command line's own rules (the Trainer checks its options itself: check_trainer_options).
void check_outputs(const Args& args, TrainerOptions& o) {
  if (args.has("keep") && o.checkpoint_dir().empty()) {
    throw UsageError("--keep needs --checkpoint-dir");
  }
  if (args.has("zero-checkpoint") && !args.has("zero")) {
    throw UsageError("--zero-checkpoint says how --zero's shards are saved: add --zero");
  }
  if (!o.checkpoint_dir().empty() && o.checkpoint_every() == 0 && !o.checkpoint_every_epoch()) {
    o.checkpoint_every_epoch(true);  // a directory alone: one checkpoint per epoch
  }
}

// The files and folders the run will write or read, tried now so that a bad path fails before
// the run rather than after it.
void probe_outputs(const TrainerOptions& o) {
  if (!o.checkpoint_dir().empty()) {
    try {
      Checkpoint probe(CheckpointOptions(o.checkpoint_dir()).keep(o.keep()));  // made, writable
    } catch (const c10::Error& e) {
      throw UsageError(e.what_without_backtrace());
    }
  }
  if (!o.tensorboard().empty()) {
    if (!tensorboard::available()) {
      throw UsageError(
          "--tensorboard: this paratrain was built without Protocol Buffers; install "
          "libprotobuf-dev and protobuf-compiler and build it again, or use --metrics");
    }
    std::error_code ec;
    std::filesystem::create_directories(o.tensorboard(), ec);
    if (ec || ::access(o.tensorboard().c_str(), W_OK) != 0) {
      throw UsageError("cannot write the --tensorboard directory " + o.tensorboard() + ": " +
                       (ec ? ec.message() : std::strerror(errno)));
    }
  }
  if (!o.trace().empty()) {
    std::ofstream probe(o.trace(), std::ios::app);  // found unwritable now, not after the run
    if (!probe) {
      throw UsageError("cannot write the --trace file " + o.trace() + ": " + std::strerror(errno));
    }
  }
  if (!o.resume().empty() && o.resume() != "auto" && ::access(o.resume().c_str(), R_OK) != 0) {
    throw UsageError("--resume " + o.resume() +
                     " does not exist: give a checkpoint's ckpt-N.json, or --resume auto");
  }
}

}  // namespace

const CommandSpec& train_spec() {
  static const CommandSpec spec{
      "paratrain train",
      "Trains a zoo model on Fashion-MNIST or an ImageFolder, or a GPT on token files: in one\n"
      "process, with DDP over several, with DataParallel over --devices, or as a pipeline of\n"
      "--stages.",
      train_option_specs(),
      "Checkpoints hold everything an exact resume needs (weights, optimizer and schedule state,\n"
      "GradScaler, O2 masters, every rank's RNG, the sampler's position); --resume auto\n"
      "continues from the newest one that verifies and ends with the weights an uninterrupted run\n"
      "ends with. --dataset imagefolder reads D/train and D/val as torchvision's ImageFolder\n"
      "(JPEG, PNG, WebP), training on RandomResizedCrop(--image-size) + horizontal flips and\n"
      "validating on Resize(size * 8 / 7) + CenterCrop(size), normalized with ImageNet's mean and\n"
      "std. --dataset tokens reads D/train.bin and D/val.bin (nanoGPT's or llm.c's token files)\n"
      "for a GPT: windows of --context tokens, at random offsets to train and side by side to\n"
      "validate, with the language-model loss (per-token cross entropy). With --strategy ddp,\n"
      "--nproc-per-node N starts N ranks; under `paratrain launch` or mpirun it joins the job.\n"
      "Example config: --config run.toml holding `model = \"resnet18\"`, `lr = 0.1`,\n"
      "`checkpoint-dir = \"ckpt\"`; later flags override it."};
  return spec;
}

// Started by a launcher that already made the ranks: paratrain launch / torchrun, mpirun, or srun
// with several tasks (a plain sbatch shell has SLURM_PROCID too, but one task).
bool inside_a_job() {
  for (const char* v : {"RANK", "OMPI_COMM_WORLD_SIZE"}) {
    const char* value = std::getenv(v);
    if (value != nullptr && value[0] != '\0') {
      return true;
    }
  }
  const char* tasks = std::getenv("SLURM_NTASKS");
  return tasks != nullptr && std::atoi(tasks) > 1;
}

bool becomes_launcher(const TrainSettings& s) {
  return (s.strategy == "ddp" || s.strategy == "fsdp") && s.nproc > 0 && !inside_a_job();
}

TrainSettings read_settings(const Args& args) {
  TrainSettings s = read_basics(args);
  check_model(args, s);
  check_data_and_strategy(args, s);
  s.amp_options = read_amp(args);
  read_pipeline(args, s);
  check_counts(s);
  s.device_kind = read_device_kind(args, s);
  return s;
}

TrainerOptions loop_options(const Args& args, const TrainSettings& s) {
  TrainerOptions o;
  o.optimizer(optimizer_options(args));
  o.lr_schedule(lr_schedule_options(args, s.epochs))
      .schedule_per_step(args.has("schedule-per-step"));
  o.clip_grad_norm(args.get_double("clip-grad-norm", 0.0));
  o.accumulate(args.get_int("accumulate", 1));
  read_outputs(args, o);
  check_outputs(args, o);
  // The Trainer's own rules, checked once here, before any rank starts, in the flags' words.
  o.strategy(parse_strategy(s.strategy))
      .devices(s.piped ? s.stage_devices : s.dp_devices)
      .chunks(s.chunks)
      .amp(s.amp_options)
      .epochs(s.epochs)
      .steps_per_epoch(s.steps)
      .batch_size(s.batch_size)
      .workers(s.workers);
  try {
    check_trainer_options(o);
  } catch (const OptionError& e) {
    throw UsageError(flag_message(e));
  }
  probe_outputs(o);
  return o;
}

// Whether text[at, end) is part of a path ("/data/epochs/run", "keep.d"): its word, spaces and
// brackets aside, holds a '/' or a '.' before its end.
bool in_a_path(const std::string& text, size_t at, size_t end) {
  const std::string stops = " \t\n()[],;";
  size_t first = text.find_last_of(stops, at == 0 ? 0 : at - 1);
  first = first == std::string::npos || (at == 0) ? 0 : first + 1;
  size_t last = text.find_first_of(stops, end);
  last = last == std::string::npos ? text.size() : last;
  while (last > first && std::string(".:").find(text[last - 1]) != std::string::npos) {
    --last;  // the end of a sentence or a clause
  }
  const std::string token = text.substr(first, last - first);
  return token.find_first_of("/.") != std::string::npos;
}

// The Trainer's words in the command line's: each TrainerOptions (or CheckpointOptions) field the
// text names becomes the flag that sets it ("checkpoint_dir" -> "--checkpoint-dir"), and "set X"
// of a switch becomes "add --x". Quoted values and paths stay as given.
std::string in_flags(const std::string& text, const std::map<std::string, std::string>& more) {
  static const std::map<std::string, std::string> flags{
      {"accumulate", "accumulate"},
      {"amp", "amp"},
      {"any_world_size", "nnodes MIN:MAX"},
      {"batch_size", "batch-size"},
      {"check_replicas", "check-replicas"},
      {"checkpoint_dir", "checkpoint-dir"},
      {"checkpoint_every", "checkpoint-every"},
      {"checkpoint_every_epoch", "checkpoint-every-epoch"},
      {"chunks", "chunks"},
      {"clip_grad_norm", "clip-grad-norm"},
      {"devices", "devices"},
      {"elastic", "nnodes MIN:MAX"},
      {"epochs", "epochs"},
      {"keep", "keep"},
      {"log_every", "log-every"},
      {"mixed_precision", "fsdp-param-dtype"},
      {"resume", "resume"},
      {"start_fresh_if_damaged", "start-fresh-if-damaged"},
      {"steps_per_epoch", "steps"},
      {"strategy", "strategy"},
      {"sync_batchnorm", "sync-bn"},
      {"workers", "workers"},
      {"zero", "zero"},
      {"zero_checkpoint", "zero-checkpoint"}};
  // Flags that take no value: the library "set"s them, a command line adds them.
  static const std::set<std::string> switches{"checkpoint_every_epoch", "start_fresh_if_damaged",
                                              "sync_batchnorm", "zero"};
  std::string out;
  for (size_t at = 0; at < text.size();) {
    // A value the user gave, quoted, stays as given (an apostrophe, as in "DDP's", opens none).
    if (text[at] == '\'' && (at == 0 || text[at - 1] == ' ' || text[at - 1] == '(')) {
      const size_t close = text.find('\'', at + 1);
      const size_t end = close == std::string::npos ? text.size() : close + 1;
      out += text.substr(at, end - at);
      at = end;
      continue;
    }
    size_t end = at;
    while (end < text.size() &&
           (std::isalnum(static_cast<unsigned char>(text[end])) != 0 || text[end] == '_')) {
      ++end;
    }
    if (end == at) {
      out += text[at++];
      continue;
    }
    const std::string word = text.substr(at, end - at);
    const auto extra = more.find(word);
    const auto known = flags.find(word);
    const std::string* flag = extra != more.end()    ? &extra->second
                              : known != flags.end() ? &known->second
                                                     : nullptr;
    const bool named = (at == 0 || std::string("-:").find(text[at - 1]) == std::string::npos) &&
                       !in_a_path(text, at, end);
    if (flag != nullptr && named) {
      const bool set =
          out.size() >= 4 && out.compare(out.size() - 4, 4, "set ") == 0 &&
          (out.size() == 4 || std::isalnum(static_cast<unsigned char>(out[out.size() - 5])) == 0);
      if (set) {
        out.replace(out.size() - 4, 4, switches.count(word) ? "add " : "give ");
      }
      out += "--" + *flag;
    } else {
      out += word;
    }
    at = end;
  }
  // The world size a job may change only when a launcher restarts it elastic: `paratrain train`
  // has no flag for it.
  const std::string elastic = "give --nnodes MIN:MAX";
  if (const size_t at = out.find(elastic); at != std::string::npos) {
    out.replace(at, elastic.size(), "start it with `paratrain launch --nnodes MIN:MAX ...`");
  }
  return out;
}

std::string flag_message(const OptionError& e) {
  return in_flags(e.what_without_backtrace());
}

}  // namespace train_detail
}  // namespace cli
}  // namespace paratrain
