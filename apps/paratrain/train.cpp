// paratrain train: train a model on a real dataset, on one process or with DDP over several.

#include "args.h"
#include "commands.h"
#include "json_line.h"

#include "paratrain/paratrain.h"

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>

namespace paratrain {
namespace cli {

namespace {

const CommandSpec& train_spec() {
  static const CommandSpec spec{
      "paratrain train",
      "Trains a zoo model on Fashion-MNIST or an ImageFolder: in one process, with DDP over\n"
      "several, with DataParallel over --devices, or as a pipeline of --stages.",
      {
          {"model", "NAME", "linear, mlp, cnn, resnet18..152 or resnet*_cifar (default mlp)"},
          {"dataset", "NAME", "fashion-mnist (default) or imagefolder"},
          {"data-dir", "DIR",
           "the dataset's folder; an ImageFolder has DIR/train and DIR/val (default: Debian's "
           "Fashion-MNIST)"},
          {"strategy", "NAME", "single (default), ddp, dp or pipeline"},
          {"nproc", "N", "with ddp: start N ranks through the launcher"},
          {"backend", "NAME", "ddp's backend: auto (default), gloo, mpi or nccl"},
          {"max-restarts", "N",
           "with --nproc: when a rank fails, stop every rank and start them all again, up to N "
           "times (torchrun's); add --resume auto to continue from the last checkpoint"},
          {"device", "KIND",
           "single and ddp: cuda (cuda:LOCAL_RANK, the default where CUDA is available) or cpu"},
          {"devices", "LIST",
           "dp: the devices the batch is scattered over; pipeline: one per stage (cpu,cpu)"},
          {"stages", "P", "pipeline stages (default 2)"},
          {"chunks", "M", "pipeline micro-batches per batch (default 4)"},
          {"schedule", "NAME", "pipeline schedule: gpipe (default) or 1f1b"},
          {"epochs", "E", "epochs (default 1)"},
          {"steps", "S", "cap on the steps of each epoch (default 0: the whole epoch)"},
          {"batch-size", "B",
           "per rank (ddp), or the whole batch (dp scatters it, pipeline cuts it) (default 64)"},
          {"workers", "K", "decoding threads; 0 decodes in the training thread (default 1)"},
          {"image-size", "N", "the model's input side (default: the model's own)"},
          {"channels", "C", "1 or 3 input channels (default: the model's own)"},
          {"head", "custom", "replace the classifier by a Linear-BN-ReLU-Dropout head"},
          {"freeze-backbone", "", "with --head custom: train the head only"},
          {"amp", "LEVEL", "mixed precision O0 (default), O1, O2 or O3"},
          {"amp-dtype", "TYPE", "with --amp: bf16 (default) or fp16"},
          {"optimizer", "NAME", "sgd (default), adam or adamw"},
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
          {"checkpoint-dir", "DIR",
           "write checkpoints there (per epoch unless --checkpoint-every)"},
          {"checkpoint-every", "N", "a checkpoint every N optimizer steps"},
          {"checkpoint-every-epoch", "", "a checkpoint at every epoch's end"},
          {"keep", "K", "keep the newest K checkpoints (default 3)"},
          {"resume", "auto|PATH",
           "continue from the newest checkpoint that verifies (auto) or from PATH (ckpt-N.json)"},
          {"metrics", "FILE", "write loss, accuracy, lr, images/s, grad norm, loss scale as JSONL"},
          {"tensorboard", "DIR", "write the same metrics as TensorBoard event files into DIR"},
          {"log-every", "N", "a metrics row every N steps (default 10 with --metrics)"},
          {"check-replicas", "N",
           "every N steps, compare the ranks' parameters and name a diverged one"},
          {"trace", "FILE", "write a Chrome trace of every rank (Perfetto, chrome://tracing)"},
          {"sync-bn", "", "ddp: BatchNorm over the whole batch of all ranks (SyncBatchNorm)"},
          {"zero", "", "ddp: shard the optimizer state over the ranks (ZeroRedundancyOptimizer)"},
          {"zero-checkpoint", "consolidated|sharded",
           "with --zero: checkpoints hold the optimizer state gathered on rank 0 (default) or "
           "each rank's shard"},
          {"save-weights", "FILE", "write the trained weights as safetensors"},
          {"load-weights", "FILE", "start from these weights (safetensors or torch.save files)"},
          {"json", "", "print each epoch as a JSON object"},
      },
      "Checkpoints hold everything an exact resume needs (weights, optimizer and schedule state,\n"
      "GradScaler, O2 masters, every rank's RNG, the sampler's position); --resume auto\n"
      "continues from the newest one that verifies and ends with the weights an uninterrupted run\n"
      "ends with. --dataset imagefolder reads D/train and D/val as torchvision's ImageFolder\n"
      "(JPEG, PNG, WebP), training on RandomResizedCrop(--image-size) + horizontal flips and\n"
      "validating on Resize(size * 8 / 7) + CenterCrop(size), normalized with ImageNet's mean and\n"
      "std. With --strategy ddp, --nproc N starts N ranks; under `paratrain launch` or mpirun it\n"
      "joins the job. Example config: --config run.toml holding `model = \"resnet18\"`,\n"
      "`lr = 0.1`, `checkpoint-dir = \"ckpt\"`; later flags override it."};
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

using Clock = std::chrono::steady_clock;

struct TrainData {
  data::DatasetPtr train;
  data::DatasetPtr test;
  int64_t classes;
};

// Fashion-MNIST as in-memory tensors, or an ImageFolder's train/ and val/ with the transforms of
// torchvision's ImageNet recipe at `size`.
TrainData load_data(const std::string& dataset, const std::string& dir, int64_t size) {
  if (dataset == "fashion-mnist") {
    data::FashionMNIST train(dir, data::FashionMNIST::Split::kTrain);
    data::FashionMNIST test(dir, data::FashionMNIST::Split::kTest);
    return {std::make_shared<data::TensorDataset>(train.images(), train.targets()),
            std::make_shared<data::TensorDataset>(test.images(), test.targets()), 10};
  }
  namespace T = data::transforms;
  const T::Normalize normalize({0.485, 0.456, 0.406}, {0.229, 0.224, 0.225});
  auto train = std::make_shared<data::ImageFolder>(
      dir + "/train",
      T::compose(T::RandomResizedCrop(size), T::RandomHorizontalFlip(), T::ToTensor(), normalize));
  auto val = std::make_shared<data::ImageFolder>(
      dir + "/val",
      T::compose(T::Resize(size * 8 / 7), T::CenterCrop(size), T::ToTensor(), normalize));
  if (train->classes() != val->classes()) {
    throw std::runtime_error("the class folders of " + dir + "/train (" +
                             std::to_string(train->classes().size()) + ") and " + dir + "/val (" +
                             std::to_string(val->classes().size()) +
                             ") differ: give both the same classes");
  }
  return {train, val, static_cast<int64_t>(train->classes().size())};
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

// The optimizer, schedule, accumulation, clipping, checkpoint and metrics flags.
TrainerOptions loop_options(const Args& args, int epochs) {
  TrainerOptions o;
  o.optimizer(OptimizerOptions()
                  .kind(args.get("optimizer", "sgd"))
                  .lr(args.get_double("lr", 0.05))
                  .momentum(args.get_double("momentum", 0.9))
                  .weight_decay(args.get_double("weight-decay", 0.0)));
  const std::string kind = o.optimizer().kind();
  if (kind != "sgd" && kind != "adam" && kind != "adamw") {
    throw UsageError("unknown --optimizer '" + kind + "': choose sgd, adam or adamw");
  }
  LRScheduleOptions ls;
  ls.kind(args.get("lr-schedule", "constant"))
      .step_size(args.get_int("lr-step-size", 30))
      .gamma(args.get_double("lr-gamma", 0.1))
      .eta_min(args.get_double("lr-eta-min", 0.0))
      .warmup(args.get_int("warmup", 0))
      .warmup_start_factor(args.get_double("warmup-start-factor", 1.0 / 3.0));
  std::vector<int64_t> milestones;
  {
    std::stringstream in(args.get("lr-milestones", ""));
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
  }
  ls.milestones(milestones);
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
  o.lr_schedule(ls).schedule_per_step(args.has("schedule-per-step"));
  o.clip_grad_norm(args.get_double("clip-grad-norm", 0.0));
  o.accumulate(args.get_int("accumulate", 1));
  if (o.clip_grad_norm() < 0 || o.accumulate() < 1) {
    throw UsageError("--clip-grad-norm must be >= 0 and --accumulate >= 1");
  }
  o.checkpoint_dir(args.get("checkpoint-dir", ""))
      .checkpoint_every(args.get_int("checkpoint-every", 0))
      .checkpoint_every_epoch(args.has("checkpoint-every-epoch"))
      .keep(args.get_int("keep", 3))
      .resume(args.get("resume", ""))
      .metrics(args.get("metrics", ""))
      .tensorboard(args.get("tensorboard", ""))
      .log_every(args.get_int("log-every", args.has("metrics") || args.has("tensorboard") ? 10 : 0))
      .check_replicas(args.get_int("check-replicas", 0))
      .trace(args.get("trace", ""))
      .sync_batchnorm(args.has("sync-bn"))
      .zero(args.has("zero"))
      .zero_checkpoint(args.get("zero-checkpoint", "consolidated"));
  if (o.zero_checkpoint() != "consolidated" && o.zero_checkpoint() != "sharded") {
    throw UsageError("--zero-checkpoint is '" + o.zero_checkpoint() +
                     "': use consolidated or sharded");
  }
  if (args.has("zero-checkpoint") && !args.has("zero")) {
    throw UsageError("--zero-checkpoint says how --zero's shards are saved: add --zero");
  }
  if (o.check_replicas() < 0) {
    throw UsageError("--check-replicas must be >= 0, got " + std::to_string(o.check_replicas()));
  }
  if (o.keep() < 1) {
    throw UsageError("--keep must be >= 1, got " + std::to_string(o.keep()) +
                     ": keeping no checkpoint could never resume");
  }
  if (o.checkpoint_every() < 0 || o.log_every() < 0) {
    throw UsageError("--checkpoint-every and --log-every must be >= 0");
  }
  if ((o.checkpoint_every() > 0 || o.checkpoint_every_epoch() || args.has("keep")) &&
      o.checkpoint_dir().empty()) {
    throw UsageError(
        "--checkpoint-every, --checkpoint-every-epoch and --keep need --checkpoint-dir");
  }
  if (!o.checkpoint_dir().empty() && o.checkpoint_every() == 0 && !o.checkpoint_every_epoch()) {
    o.checkpoint_every_epoch(true);  // a directory alone: one checkpoint per epoch
  }
  if (o.resume() == "auto" && o.checkpoint_dir().empty()) {
    throw UsageError("--resume auto needs --checkpoint-dir (where to look)");
  }
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
  return o;
}

// Tests and `paratrain bench faults` kill a rank at a chosen step: PARATRAIN_FAULT_AT_STEP=S
// (and PARATRAIN_FAULT_RANK=R, default 0) SIGKILLs rank R right after optimizer step S, on the
// first attempt only (TORCHELASTIC_RESTART_COUNT unset or 0). PARATRAIN_FAULT=perturb nudges
// that rank's last parameter instead, for --check-replicas.
void install_fault(Trainer& trainer, int rank) {
  const char* at = std::getenv("PARATRAIN_FAULT_AT_STEP");
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const char* who = std::getenv("PARATRAIN_FAULT_RANK");
  if (at == nullptr || (restart != nullptr && std::atoi(restart) != 0) ||
      (who != nullptr ? std::atoi(who) : 0) != rank) {
    return;
  }
  const int64_t step = std::atoll(at);
  const char* how = std::getenv("PARATRAIN_FAULT");
  const bool perturb = how != nullptr && std::string(how) == "perturb";
  trainer.on_step_end([&trainer, step, perturb](const StepInfo& info) {
    if (info.global_step != step) {
      return;
    }
    if (perturb) {  // PARATRAIN_FAULT=perturb: this rank's weights drift (--check-replicas)
      torch::NoGradGuard no_grad;
      trainer.model()->parameters().back().add_(1e-3);
      return;
    }
    ::kill(::getpid(), SIGKILL);
  });
}

}  // namespace

int run_train(const std::vector<std::string>& argv) {
  Args args(argv, train_spec());
  if (args.has("help")) {
    std::cout << args.help();
    return 0;
  }
  const std::string model_name = args.get("model", "mlp");
  const std::string dataset = args.get("dataset", "fashion-mnist");
  const std::string strategy = args.get("strategy", "single");
  const int epochs = args.get_int("epochs", 1);
  const int steps = args.get_int("steps", 0);
  const int batch_size = args.get_int("batch-size", 64);
  const double lr = args.get_double("lr", 0.05);
  const double momentum = args.get_double("momentum", 0.9);
  const double weight_decay = args.get_double("weight-decay", 0.0);
  const int seed = args.get_int("seed", 0);
  const int workers = args.get_int("workers", 1);
  const int nproc = args.get_int("nproc", 0);
  const bool json = args.has("json");
  const std::string data_dir = args.get("data-dir", data::kFashionMnistDir);

  {
    const auto known = models::names();
    if (std::find(known.begin(), known.end(), model_name) == known.end()) {
      std::string list;
      for (const auto& n : known) {
        list += (list.empty() ? "" : ", ") + n;
      }
      throw UsageError("unknown --model '" + model_name + "': choose " + list);
    }
  }
  const std::vector<int64_t> expects = models::input_shape(model_name);
  const int image_size = args.get_int("image-size", static_cast<int>(expects[1]));
  const int channels = args.get_int("channels", static_cast<int>(expects[0]));
  if (image_size < 1 || (channels != 1 && channels != 3)) {
    throw UsageError("--image-size must be >= 1 and --channels 1 or 3");
  }
  const std::string head = args.get("head", "");
  if (!head.empty() && head != "custom") {
    throw UsageError("unknown --head '" + head +
                     "': the one head is 'custom' (a "
                     "Linear-BN-ReLU-Dropout classifier)");
  }
  if (args.has("freeze-backbone") && head.empty()) {
    throw UsageError("--freeze-backbone goes with --head custom");
  }
  if (dataset != "fashion-mnist" && dataset != "imagefolder") {
    throw UsageError("unknown --dataset '" + dataset + "': choose fashion-mnist or imagefolder");
  }
  if (dataset == "imagefolder" && !args.has("data-dir")) {
    throw UsageError("--dataset imagefolder needs --data-dir D (with D/train and D/val)");
  }
  if (strategy != "single" && strategy != "ddp" && strategy != "dp" && strategy != "pipeline") {
    throw UsageError("unknown --strategy '" + strategy + "': choose single, ddp, dp or pipeline");
  }
  for (const char* flag : {"sync-bn", "zero"}) {
    if (args.has(flag) && strategy != "ddp") {
      throw UsageError(std::string("--") + flag + " works across DDP's ranks: add --strategy ddp " +
                       "(got --strategy " + strategy + ")");
    }
  }
  std::vector<torch::Device> dp_devices;
  if (strategy == "dp" && !args.has("devices")) {
    throw UsageError("--strategy dp needs --devices (e.g. --devices cpu,cpu)");
  }
  if (args.has("devices") && strategy != "dp" && strategy != "pipeline") {
    throw UsageError("--devices goes with --strategy dp or pipeline");
  }
  if (strategy == "dp") {
    dp_devices = parse_devices(args.get("devices"));
  }
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
  const bool piped = strategy == "pipeline";
  if (!piped && (args.has("stages") || args.has("chunks") || args.has("schedule"))) {
    throw UsageError("--stages, --chunks and --schedule go with --strategy pipeline");
  }
  const int stages = args.get_int("stages", 2);
  const int chunks = args.get_int("chunks", 4);
  std::vector<torch::Device> stage_devices;
  pipeline::Schedule schedule = pipeline::Schedule::kGPipe;
  if (piped) {
    if (stages < 1) {
      throw UsageError("--stages must be >= 1, got " + std::to_string(stages));
    }
    if (chunks < 1) {
      throw UsageError("--chunks must be >= 1, got " + std::to_string(chunks));
    }
    if (chunks > batch_size) {
      throw UsageError("--chunks (" + std::to_string(chunks) + ") is larger than --batch-size (" +
                       std::to_string(batch_size) + "): a micro-batch needs a sample");
    }
    try {
      schedule = pipeline::parse_schedule(args.get("schedule", "gpipe"));
    } catch (const c10::Error& e) {
      throw UsageError(e.what_without_backtrace());
    }
    stage_devices = args.has("devices")
                        ? parse_devices(args.get("devices"))
                        : std::vector<torch::Device>(static_cast<size_t>(stages), torch::kCPU);
    if (stage_devices.size() != static_cast<size_t>(stages)) {
      throw UsageError("--devices names " + std::to_string(stage_devices.size()) + " devices for " +
                       std::to_string(stages) + " stages; give one per stage");
    }
  }
  if (epochs <= 0) {
    throw UsageError("--epochs must be positive, got " + std::to_string(epochs));
  }
  if (batch_size <= 0) {
    throw UsageError("--batch-size must be positive, got " + std::to_string(batch_size));
  }
  if (workers < 0) {
    throw UsageError("--workers must be >= 0, got " + std::to_string(workers) +
                     " (0 loads data in the training thread)");
  }
  if (steps < 0 || lr <= 0 || momentum < 0 || weight_decay < 0) {
    throw UsageError("--steps, --momentum and --weight-decay must be >= 0, --lr > 0");
  }
  if (nproc < 0 || (nproc > 0 && strategy != "ddp")) {
    throw UsageError("--nproc needs --strategy ddp and a positive count");
  }
  const std::string device_kind = args.get("device", torch::cuda::is_available() ? "cuda" : "cpu");
  if (device_kind != "cpu" && device_kind != "cuda") {
    throw UsageError("unknown --device '" + device_kind + "': choose cpu or cuda");
  }
  if (args.has("device") && (strategy == "dp" || strategy == "pipeline")) {
    throw UsageError("--device goes with --strategy single or ddp; dp and pipeline take --devices");
  }
  if (device_kind == "cuda") {
    try {
      check_device_exists(torch::Device(torch::kCUDA));
      if (strategy == "ddp" && nproc > 0 && !inside_a_job()) {
        dist::check_ranks_fit_gpus(nproc, static_cast<int>(torch::cuda::device_count()));
      }
    } catch (const c10::Error& e) {
      throw UsageError(e.what_without_backtrace());
    }
  }

  TrainerOptions o = loop_options(args, epochs);  // checked once, before any rank starts

  // ddp with --nproc outside a job: become the launcher of N copies of this command.
  if (strategy == "ddp" && nproc > 0 && !inside_a_job()) {
    std::vector<std::string> command{self_path(), "train"};
    for (size_t i = 0; i < argv.size(); ++i) {
      if (argv[i] == "--nproc") {
        ++i;
        continue;
      }
      if (argv[i] == "--max-restarts") {
        ++i;  // the launcher restarts; the ranks do not
        continue;
      }
      if (argv[i].rfind("--nproc=", 0) == 0 || argv[i].rfind("--max-restarts=", 0) == 0) {
        continue;
      }
      command.push_back(argv[i]);
    }
    // The ranks neither launch nor restart, whatever a --config file says.
    command.insert(command.end(), {"--nproc", "0", "--max-restarts", "0"});
    dist::LaunchOptions lo;
    lo.nproc_per_node(nproc).standalone(true).command(command).prefix_output(false).name(
        "paratrain train");
    const int restarts = args.get_int("max-restarts", 0);
    if (restarts < 0) {
      throw UsageError("--max-restarts must be >= 0, got " + std::to_string(restarts));
    }
    lo.max_restarts(restarts);
    if (restarts > 0 && o.resume() != "auto") {
      std::cerr << "paratrain train: note: --max-restarts without --resume auto starts each "
                   "restart from step 0"
                << std::endl;
    }
    const std::string backend = args.get("backend", "auto");
    if (backend != "auto") {
      lo.backend(backend).mpi_shim({self_path(), "launch", "--from-mpirun", "--no-prefix"});
    }
    dist::LaunchResult r = dist::launch(lo);
    if (!r.summary.empty()) {
      std::cerr << r.summary << std::endl;
    }
    return r.exit_code;
  }

  if (args.get_int("max-restarts", 0) != 0) {
    throw UsageError("--max-restarts goes with --strategy ddp --nproc N (or paratrain launch)");
  }
  dist::ProcessGroupPtr pg;
  if (strategy == "ddp") {
    pg = dist::init_process_group(
        dist::InitOptions().backend(args.get("backend", "auto")).uses_cuda(device_kind == "cuda"));
  }
  const int rank = pg ? pg->rank() : 0;
  const int world = pg ? pg->size() : 1;
  const bool speak = rank == 0;
  std::ostream& info = json ? std::cerr : std::cout;

  // Data first: a missing dataset should fail before any training is set up.
  const TrainData sets = load_data(dataset, data_dir, image_size);
  const torch::Device device =
      device_kind == "cuda" ? dist::local_device() : torch::Device(torch::kCPU);

  torch::manual_seed(seed);  // the same initial weights on every run
  // With --head custom the backbone keeps its 1000-class fc until the head replaces it, so
  // torchvision's ImageNet weights load as they are.
  torch::nn::Sequential model = models::make(model_name, head.empty() ? sets.classes : 1000);
  if (args.has("load-weights")) {
    load_module_state(*model, load_weights(args.get("load-weights")));  // strict, as PyTorch
  }
  if (!head.empty()) {
    model = models::with_head(model, sets.classes);
    if (args.has("freeze-backbone")) {
      models::freeze_backbone(model);
    }
  }
  const int64_t n_params = [&] {
    int64_t n = 0;
    for (const auto& p : model->parameters()) {
      n += p.numel();
    }
    return n;
  }();
  const std::vector<int64_t> balance =
      piped ? pipeline::balance_by_parameters(model, stages) : std::vector<int64_t>{};

  // What a checkpoint must agree on to resume this run (not --epochs: a run may be extended).
  const char* elastic_env = std::getenv("PARATRAIN_ELASTIC");
  const bool elastic = elastic_env != nullptr && std::string(elastic_env) == "1";
  o.elastic(elastic);
  const nlohmann::json config{
      {"model", model_name},
      {"dataset", dataset},
      {"strategy", strategy},
      // An elastic job's world changes between attempts (PARATRAIN_ELASTIC, set by the launcher).
      {"world_size", elastic ? -1 : world},
      {"batch_size", batch_size},
      {"steps", steps},
      {"optimizer", o.optimizer().kind()},
      {"lr", lr},
      {"momentum", momentum},
      {"weight_decay", weight_decay},
      {"lr_schedule", o.lr_schedule().kind()},
      {"warmup", o.lr_schedule().warmup()},
      {"accumulate", o.accumulate()},
      {"clip_grad_norm", o.clip_grad_norm()},
      {"seed", seed},
      {"amp", args.get("amp", "O0")},
      {"amp_dtype", args.get("amp-dtype", "")},
      {"image_size", image_size},
      {"channels", channels},
      {"head", head},
      {"devices", args.get("devices", "")},
      {"chunks", piped ? chunks : 0},
      {"stages", piped ? stages : 0},
      {"schedule", piped ? pipeline::to_string(schedule) : ""},
      {"freeze_backbone", args.has("freeze-backbone")},
      {"sync_bn", args.has("sync-bn")},
      {"schedule_per_step", o.schedule_per_step()},
      {"lr_step_size", o.lr_schedule().step_size()},
      {"lr_gamma", o.lr_schedule().gamma()},
      {"lr_milestones", o.lr_schedule().milestones()},
      // T_max only for cosine: it follows --epochs by default.
      {"lr_t_max", o.lr_schedule().kind() == "cosine" ? o.lr_schedule().t_max() : 0},
      {"lr_eta_min", o.lr_schedule().eta_min()},
      {"warmup_start_factor", o.lr_schedule().warmup_start_factor()}};
  o.strategy(parse_strategy(strategy))
      .device(device)
      .devices(piped ? stage_devices : dp_devices)
      .chunks(chunks)
      .pipeline_schedule(schedule)
      .process_group(pg)
      .amp(amp_options)
      .epochs(epochs)
      .steps_per_epoch(steps)
      .batch_size(batch_size)
      .eval_batch_size(dataset == "fashion-mnist" ? 1000 : batch_size)
      .workers(workers)
      .seed(static_cast<uint64_t>(seed))
      .input_transform([image_size, channels](const torch::Tensor& images) {
        return data::adapt_images(images, image_size, channels);
      })
      .config(config.dump());
  Trainer trainer(model, sets.train, sets.test, o);
  install_fault(trainer, rank);
  amp::MixedPrecision& mp = trainer.mixed_precision();
  if (speak) {
    std::ostringstream d;
    const auto& list = piped ? stage_devices : dp_devices;
    if (list.empty()) {
      d << " " << device;
    }
    for (size_t i = 0; i < list.size(); ++i) {
      d << (i == 0 ? "s " : ",") << list[i];
    }
    if (piped) {
      d << " (" << stages << " stages, balance " << c10::IntArrayRef(balance) << ", " << chunks
        << " chunks, " << pipeline::to_string(schedule) << ")";
    }
    info << "paratrain train: model " << model_name << " (" << n_params << " parameters), dataset "
         << dataset << " (" << sets.train->size() << " train, " << sets.test->size() << " test, "
         << sets.classes << " classes), strategy " << strategy << ", " << world << " rank"
         << (world == 1 ? "" : "s") << (pg ? " (" + pg->backend_name() + ")" : "") << ", device"
         << d.str() << ", batch " << batch_size
         << (!dp_devices.empty() ? " (whole, scattered), "
             : piped             ? " (whole, micro-batched), "
                                 : " per rank, ")
         << trainer.steps_per_epoch() << " steps per epoch, " << o.optimizer().kind() << " lr "
         << lr << ", momentum " << momentum << ", weight decay " << weight_decay << ", seed "
         << seed << ", " << at::get_num_threads() << " threads per rank"
         << (mp.opt_level() == amp::OptLevel::kO0
                 ? std::string()
                 : ", amp " + amp::to_string(mp.opt_level()) + " (" +
                       (mp.dtype() == torch::kBFloat16 ? "bf16" : "fp16") +
                       (mp.loss_scaling() ? ", dynamic loss scaling" : "") + ")")
         << std::endl;
  }
  const bool progress = speak && !json && ::isatty(1);
  if (progress) {
    const int64_t per_epoch = trainer.steps_per_epoch();
    trainer.on_step_end([&, per_epoch](const StepInfo& s) {
      const int64_t in_epoch = s.global_step - s.epoch * per_epoch;
      std::printf("\repoch %lld/%d step %lld/%lld", static_cast<long long>(s.epoch + 1), epochs,
                  static_cast<long long>(in_epoch), static_cast<long long>(per_epoch));
      std::fflush(stdout);
    });
  }
  trainer.on_epoch_end([&](const EpochResult& r) {
    if (json && o.checkpoint_every_epoch()) {
      // A reader of these rows (paratrain tune) may stop the job as soon as it sees one: the
      // epoch's checkpoint is on disk on every rank before the row is printed.
      trainer.wait_for_checkpoint();
      if (pg) {
        pg->barrier()->wait();
      }
    }
    if (!speak) {
      return;
    }
    if (progress) {
      std::printf("\n");
    }
    if (json) {
      std::cout << json_line({{"epoch", r.epoch + 1},
                              {"train_loss", r.train_loss},
                              {"test_accuracy", r.val_accuracy},
                              {"images_per_sec", r.images_per_sec},
                              {"seconds", r.seconds},
                              {"data_wait_seconds", r.data_wait_seconds}})
                << std::endl;
    } else {
      std::cout << std::fixed << std::setprecision(4) << "epoch " << r.epoch + 1 << "/" << epochs
                << ": train_loss " << r.train_loss << ", test_accuracy " << r.val_accuracy
                << ", lr " << std::setprecision(6) << r.lr << ", images/s " << std::setprecision(0)
                << r.images_per_sec << " (" << std::setprecision(1) << r.seconds << " s, "
                << r.data_wait_seconds << " s waiting for data)" << std::endl;
    }
  });
  try {
    trainer.fit();
  } catch (const NonFiniteLoss& e) {
    std::cerr << "paratrain train: " << e.what() << std::endl;
    return 1;
  } catch (const ReplicaDivergence& e) {
    std::cerr << "paratrain train: " << e.what() << std::endl;
    return 1;
  }
  if (args.has("save-weights") && speak) {
    save_safetensors(trainer.weights(), args.get("save-weights"));
    info << "paratrain train: weights written to " << args.get("save-weights") << std::endl;
  }
  if (pg) {
    pg->barrier()->wait();  // nobody leaves while rank 0 still writes
  }
  return 0;
}

}  // namespace cli
}  // namespace paratrain
