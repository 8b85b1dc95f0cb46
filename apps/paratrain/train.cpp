// paratrain train: train a model on a real dataset, on one process or with DDP over several.
// The command line is read and checked in train_options.cpp; this file runs it.

#include "commands.h"
#include "json_line.h"
#include "train_options.h"

#include "paratrain/data/tokens.h"
#include "paratrain/models/gpt.h"
#include "paratrain/models/gpt_pretrained.h"
#include "paratrain/paratrain.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace paratrain {
namespace cli {

namespace {

using train_detail::TrainSettings;

struct TrainData {
  data::DatasetPtr train;
  data::DatasetPtr test;
  int64_t classes;
};

// DIR/train.bin and DIR/val.bin as windows of the model's context: training windows at random
// offsets, as nanoGPT's get_batch draws them but fixed per index and seed (a resumed run reads
// the same ones), validation windows side by side, so every run scores the same tokens.
TrainData load_tokens(const TrainSettings& s) {
  const int64_t context = s.gpt_options.context();
  const int64_t vocab = s.gpt_options.vocab();
  auto train = std::make_shared<data::TokenDataset>(s.data_dir + "/train.bin",
                                                    data::TokenDatasetOptions(context)
                                                        .windows("random")
                                                        .seed(static_cast<uint64_t>(s.seed))
                                                        .vocab(vocab));
  auto val = std::make_shared<data::TokenDataset>(s.data_dir + "/val.bin",
                                                  data::TokenDatasetOptions(context).vocab(vocab));
  return {train, val, vocab};
}

// Fashion-MNIST as in-memory tensors, an ImageFolder's train/ and val/ with the transforms of
// torchvision's ImageNet recipe at --image-size, or token files.
TrainData load_data(const TrainSettings& s) {
  const std::string& dataset = s.dataset;
  const std::string& dir = s.data_dir;
  const int64_t size = s.image_size;
  if (dataset == "tokens") {
    return load_tokens(s);
  }
  if (dataset == "fashion-mnist") {
    try {
      data::FashionMNIST train(dir, data::FashionMNIST::Split::kTrain);
      data::FashionMNIST test(dir, data::FashionMNIST::Split::kTest);
      return {std::make_shared<data::TensorDataset>(train.images(), train.targets()),
              std::make_shared<data::TensorDataset>(test.images(), test.targets()), 10};
    } catch (const OptionError& e) {  // the dataset's root is --data-dir
      throw std::runtime_error(
          train_detail::in_flags(e.what_without_backtrace(), {{"root", "data-dir"}}));
    }
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

// The ranks' command line: this one without the launcher's own flags.
std::vector<std::string> rank_command(const std::vector<std::string>& argv) {
  std::vector<std::string> command{self_path(), "train"};
  for (size_t i = 0; i < argv.size(); ++i) {
    if (argv[i] == "--nproc-per-node" || argv[i] == "--nproc_per_node" || argv[i] == "--nproc") {
      ++i;
      continue;
    }
    if (argv[i] == "--max-restarts") {
      ++i;  // the launcher restarts; the ranks do not
      continue;
    }
    if (argv[i].rfind("--nproc-per-node=", 0) == 0 || argv[i].rfind("--nproc_per_node=", 0) == 0 ||
        argv[i].rfind("--nproc=", 0) == 0 || argv[i].rfind("--max-restarts=", 0) == 0) {
      continue;
    }
    command.push_back(argv[i]);
  }
  // The ranks neither launch nor restart, whatever a --config file says.
  command.insert(command.end(), {"--nproc-per-node", "0", "--max-restarts", "0"});
  return command;
}

// ddp with --nproc-per-node outside a job: become the launcher of N copies of this command.
int launch_ranks(const Args& args,
                 const std::vector<std::string>& argv,
                 int nproc,
                 const TrainerOptions& o) {
  dist::LaunchOptions lo;
  lo.nproc_per_node(nproc)
      .standalone(true)
      .command(rank_command(argv))
      .prefix_output(false)
      .adopt_orphans(true)  // as `paratrain launch`: nothing the ranks start outlives the job
      .name("paratrain train");
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

// Where this process trains: its place in the job (one rank without ddp) and its device.
struct Placement {
  dist::ProcessGroupPtr pg;  // null without ddp
  int rank = 0;
  int world = 1;
  torch::Device device = torch::kCPU;
};

// Whether the GPT is built with its weights deferred, for FSDP to write and shard one unit at a
// time (FsdpOptions::param_init_fn): no rank then holds the whole model, whatever its size. Not
// when something reads the whole model first: loaded weights, tensor parallelism, stages; nor
// on a GPU, where the units would be written by the device's generator, not gpt()'s draws.
bool defers_init(const Args& args, const TrainSettings& s) {
  return s.gpt && s.strategy == "fsdp" && s.device_kind != "cuda" && !args.has("load-weights") &&
         args.get_int("tp", 1) <= 1 && args.get_int("pp", 1) <= 1;
}

torch::nn::Sequential build_model(const Args& args, const TrainSettings& s, int64_t classes) {
  torch::manual_seed(s.seed);  // the same initial weights on every run
  if (s.gpt) {
    torch::nn::Sequential model =
        models::gpt(models::GptOptions(s.gpt_options).defer_init(defers_init(args, s)));
    if (args.has("load-weights")) {
      models::load_gpt_weights(model, args.get("load-weights"));
    }
    return model;
  }
  // With --head custom the backbone keeps its 1000-class fc until the head replaces it, so
  // torchvision's ImageNet weights load as they are.
  torch::nn::Sequential model = models::make(s.model_name, s.head.empty() ? classes : 1000);
  if (args.has("load-weights")) {
    load_module_state(*model, load_weights(args.get("load-weights")));  // strict, as PyTorch
  }
  if (!s.head.empty()) {
    model = models::with_head(model, classes);
    if (args.has("freeze-backbone")) {
      models::freeze_backbone(model);
    }
  }
  return model;
}

int64_t count_parameters(const torch::nn::Sequential& model) {
  int64_t n = 0;
  for (const auto& p : model->parameters()) {
    n += p.numel();
  }
  return n;
}

// What a checkpoint must agree on to resume this run (not --epochs: a run may be extended).
nlohmann::json resume_config(const Args& args,
                             const TrainSettings& s,
                             const TrainerOptions& o,
                             int world) {
  const bool piped = s.piped;
  const LRScheduleOptions& ls = o.lr_schedule();
  nlohmann::json config{
      {"model", s.model_name},
      {"dataset", s.dataset},
      {"strategy", s.strategy},
      // An elastic job's world changes between attempts (PARATRAIN_ELASTIC, set by the launcher).
      {"world_size", o.elastic() ? -1 : world},
      {"batch_size", s.batch_size},
      {"steps", s.steps},
      {"optimizer", o.optimizer().kind()},
      {"lr", s.lr},
      {"momentum", s.momentum},
      {"weight_decay", s.weight_decay},
      {"lr_schedule", ls.kind()},
      {"warmup", ls.warmup()},
      {"accumulate", o.accumulate()},
      {"clip_grad_norm", o.clip_grad_norm()},
      {"seed", s.seed},
      {"amp", args.get("amp", "O0")},
      {"amp_dtype", args.get("amp-dtype", "")},
      {"image_size", s.image_size},
      {"channels", s.channels},
      {"head", s.head},
      {"devices", args.get("devices", "")},
      {"chunks", piped ? s.chunks : 0},
      {"stages", piped ? s.stages : 0},
      {"schedule", piped ? pipeline::to_string(s.schedule) : ""},
      {"freeze_backbone", args.has("freeze-backbone")},
      {"sync_bn", args.has("sync-bn")},
      {"schedule_per_step", o.schedule_per_step()},
      {"lr_step_size", ls.step_size()},
      {"lr_gamma", ls.gamma()},
      {"lr_milestones", ls.milestones()},
      // T_max only for cosine: it follows --epochs by default.
      {"lr_t_max", ls.kind() == "cosine" ? ls.t_max() : 0},
      {"lr_eta_min", ls.eta_min()},
      {"warmup_start_factor", ls.warmup_start_factor()}};
  if (s.gpt) {  // only then: the configs of the other models' checkpoints stay as they were
    const models::GptOptions& g = s.gpt_options;
    config["gpt"] = {{"layers", g.layers()}, {"width", g.width()},     {"heads", g.heads()},
                     {"vocab", g.vocab()},   {"context", g.context()}, {"dropout", g.dropout()}};
  }
  return config;
}

// The settings the loop options do not hold yet: strategy, devices, batches, data, config.
// --strategy fsdp's options: the default units (a GPT's blocks), checkpointing, the gather dtype.
FsdpOptions fsdp_options(const Args& args, const TrainSettings& s) {
  FsdpOptions f;
  if (defers_init(args, s)) {
    f.param_init_fn(models::gpt_init_weights);  // the same weights as gpt() builds at once
  }
  f.activation_checkpointing(args.has("checkpoint-activations"));
  if (args.has("fsdp-param-dtype")) {
    f.mixed_precision(
        FsdpMixedPrecision()
            .param_dtype(args.get("fsdp-param-dtype") == "bf16" ? torch::kBFloat16 : torch::kHalf)
            .reduce_dtype(torch::kFloat)
            .output_dtype(torch::kFloat));
  }
  return f;
}

void configure_run(TrainerOptions& o,
                   const Args& args,
                   const TrainSettings& s,
                   const Placement& where) {
  const char* elastic_env = std::getenv("PARATRAIN_ELASTIC");
  o.elastic(elastic_env != nullptr && std::string(elastic_env) == "1");
  const nlohmann::json config = resume_config(args, s, o, where.world);
  // The config's world size is -1 in an elastic job: it is not compared. The Trainer checks the
  // checkpoint's number of ranks itself, from its manifest (an elastic job takes any), and names
  // both counts.
  std::vector<std::string> may_change = o.resume_may_change();
  may_change.push_back("world_size");
  o.resume_may_change(may_change);
  const int image_size = s.image_size;
  const int channels = s.channels;
  o.strategy(parse_strategy(s.strategy))
      .device(where.device)
      .devices(s.piped ? s.stage_devices : s.dp_devices)
      .chunks(s.chunks)
      .pipeline_schedule(s.schedule)
      .process_group(where.pg)
      .fsdp(fsdp_options(args, s))
      .mesh(MeshOptions()
                .dp_replicate(static_cast<int>(args.get_int("dp-replicate", 1)))
                .dp_shard(static_cast<int>(args.get_int("dp-shard", -1)))
                .tp(static_cast<int>(args.get_int("tp", 1)))
                .pp(static_cast<int>(args.get_int("pp", 1)))
                .sequence_parallel(!args.has("no-sequence-parallel"))
                .loss_parallel(!args.has("no-loss-parallel")))
      .amp(s.amp_options)
      .epochs(s.epochs)
      .steps_per_epoch(s.steps)
      .batch_size(s.batch_size)
      .eval_batch_size(s.dataset == "fashion-mnist" ? 1000 : s.batch_size)
      .workers(s.workers)
      .seed(static_cast<uint64_t>(s.seed))
      .config(config.dump());
  if (!s.gpt) {  // token ids go to the model as they are
    o.input_transform([image_size, channels](const torch::Tensor& images) {
      return data::adapt_images(images, image_size, channels);
    });
  }
}

// The setup line's "device" part: the one device, or the list dp scatters over or the stages run
// on, and how the pipeline cut the model.
std::string describe_devices(const TrainSettings& s,
                             torch::Device device,
                             const std::vector<int64_t>& balance) {
  std::ostringstream d;
  const auto& list = s.piped ? s.stage_devices : s.dp_devices;
  if (list.empty()) {
    d << " " << device;
  }
  for (size_t i = 0; i < list.size(); ++i) {
    d << (i == 0 ? "s " : ",") << list[i];
  }
  if (s.piped) {
    d << " (" << s.stages << " stages, balance " << c10::IntArrayRef(balance) << ", " << s.chunks
      << " chunks, " << pipeline::to_string(s.schedule) << ")";
  }
  return d.str();
}

std::string describe_amp(amp::MixedPrecision& mp) {
  return mp.opt_level() == amp::OptLevel::kO0
             ? std::string()
             : ", amp " + amp::to_string(mp.opt_level()) + " (" +
                   (mp.dtype() == torch::kBFloat16 ? "bf16" : "fp16") +
                   (mp.loss_scaling() ? ", dynamic loss scaling" : "") + ")";
}

// The setup line's "model ..., dataset ..." part; a GPT's shape and the token windows.
std::string describe_model_and_data(const TrainSettings& s,
                                    const TrainData& sets,
                                    int64_t n_params) {
  std::ostringstream d;
  d << "model " << s.model_name << " (";
  if (s.gpt) {
    const models::GptOptions& g = s.gpt_options;
    d << g.layers() << " layers, width " << g.width() << ", " << g.heads() << " heads, context "
      << g.context() << ", vocab " << g.vocab() << "; ";
  }
  d << n_params << " parameters), dataset " << s.dataset << " (" << sets.train->size() << " train, "
    << sets.test->size() << " test";
  if (s.gpt) {
    d << " windows of " << s.gpt_options.context() << " tokens)";
  } else {
    d << ", " << sets.classes << " classes)";
  }
  return d.str();
}

// ", offload optimizer,gradients in /scratch," (before the learning rate).
std::string describe_offload(const TrainOffloadOptions& off) {
  if (!off.any()) {
    return "";
  }
  std::string parts = off.optimizer() ? "optimizer" : "";
  parts += off.gradients() ? std::string(parts.empty() ? "" : ",") + "gradients" : "";
  parts += off.params() ? std::string(parts.empty() ? "" : ",") + "params" : "";
  return ", offload " + parts + (off.dir().empty() ? " in host memory," : " in " + off.dir() + ",");
}

// Rank 0's one line about the run, before the first epoch.
void print_setup(std::ostream& info,
                 const TrainSettings& s,
                 const TrainData& sets,
                 int64_t n_params,
                 const std::vector<int64_t>& balance,
                 const Placement& where,
                 Trainer& trainer,
                 const TrainerOptions& o) {
  const int world = where.world;
  const MeshOptions& m = o.mesh();
  std::string mesh;
  if (m.is_mesh()) {
    const auto dims = mesh_dims(world, m.dp_replicate(), m.dp_shard(), m.tp(), m.pp());
    mesh = " on mesh " + DeviceMesh::describe(dims);
    if (m.tp() > 1) {
      mesh += std::string(m.sequence_parallel() ? " with" : " without") + " sequence parallel" +
              (m.loss_parallel() ? ", loss parallel" : "");
    }
  }
  info << "paratrain train: " << describe_model_and_data(s, sets, n_params) << ", strategy "
       << s.strategy << mesh << ", " << world << " rank" << (world == 1 ? "" : "s")
       << (where.pg ? " (" + where.pg->backend_name() + ")" : "") << ", device"
       << describe_devices(s, where.device, balance) << ", batch " << s.batch_size
       << (!s.dp_devices.empty() ? " (whole, scattered), "
           : s.piped             ? " (whole, micro-batched), "
           : m.is_mesh()         ? " per data-parallel rank, "
                                 : " per rank, ")
       << trainer.steps_per_epoch() << " steps per epoch, " << o.optimizer().kind()
       << (!o.optimizer().fused() && !o.offload().any() ? ""
           : where.device.is_cpu()                      ? " (fused, " + optim::fused_isa() + ")"
                                   : " (fused on CPU parameters only: libtorch's step here)")
       << describe_offload(o.offload()) << " lr " << s.lr << ", momentum " << s.momentum
       << ", weight decay " << s.weight_decay << ", seed " << s.seed << ", "
       << at::get_num_threads() << " threads per rank" << describe_amp(trainer.mixed_precision())
       << std::endl;
}

// On a terminal, "epoch E/N step S/T" rewritten in place after every step.
void show_progress(Trainer& trainer, int epochs) {
  const int64_t per_epoch = trainer.steps_per_epoch();
  trainer.on_step_end([epochs, per_epoch](const StepInfo& s) {
    const int64_t in_epoch = s.global_step - s.epoch * per_epoch;
    std::printf("\repoch %lld/%d step %lld/%lld", static_cast<long long>(s.epoch + 1), epochs,
                static_cast<long long>(in_epoch), static_cast<long long>(per_epoch));
    std::fflush(stdout);
  });
}

// One line per epoch. `context`: the tokens per sample of a GPT (0 otherwise), whose throughput
// is counted in tokens.
void print_epoch(const EpochResult& r, bool json, int epochs, int64_t context) {
  const double tokens_per_sec = r.images_per_sec * static_cast<double>(context);
  if (!r.trained) {
    // Resumed from a checkpoint of the epoch's last step: its training was an earlier run's, so
    // there is no loss or throughput of it to show; the evaluation is this run's. As in the
    // --metrics row, the training values are left out rather than shown as zeros.
    if (json) {
      std::cout << json_line(JsonRow{{"epoch", r.epoch + 1},
                                     {"test_accuracy", r.val_accuracy},
                                     {"test_loss", r.val_loss},
                                     {"resumed", true}})
                << std::endl;
    } else {
      std::cout << std::fixed << std::setprecision(4) << "epoch " << r.epoch + 1 << "/" << epochs
                << ": trained before the resume; test_accuracy " << r.val_accuracy << ", test_loss "
                << r.val_loss << ", lr " << std::setprecision(6) << r.lr << std::endl;
    }
    return;
  }
  if (json) {
    JsonRow row{{"epoch", r.epoch + 1},
                {"train_loss", r.train_loss},
                {"test_accuracy", r.val_accuracy},
                {"test_loss", r.val_loss},
                {"images_per_sec", r.images_per_sec},
                {"seconds", r.seconds},
                {"data_wait_seconds", r.data_wait_seconds}};
    if (context > 0) {
      row["tokens_per_sec"] = tokens_per_sec;
    }
    std::cout << json_line(row) << std::endl;
  } else {
    std::cout << std::fixed << std::setprecision(4) << "epoch " << r.epoch + 1 << "/" << epochs
              << ": train_loss " << r.train_loss << ", test_accuracy " << r.val_accuracy
              << ", test_loss " << r.val_loss << ", lr " << std::setprecision(6) << r.lr
              << (context > 0 ? ", tokens/s " : ", images/s ") << std::setprecision(0)
              << (context > 0 ? tokens_per_sec : r.images_per_sec) << " (" << std::setprecision(1)
              << r.seconds << " s, " << r.data_wait_seconds << " s waiting for data)" << std::endl;
  }
}

// Under `paratrain tune`, PARATRAIN_TRIAL_SYNC names a FIFO the tuner answers each epoch's row
// on, as Ray Tune's report() waits for the driver: the trial goes on only when told to, so a trial
// the scheduler pauses or stops has not trained (and checkpointed) epochs past the row it was
// judged on. No answer means the tuner stops the job; end of file (no tuner) means go on.
// Opened before training, without blocking (a FIFO's open waits for a writer); read blocking.
// -1 when there is none.
int open_tuner_sync() {
  const char* path = std::getenv("PARATRAIN_TRIAL_SYNC");
  if (path == nullptr || *path == '\0') {
    return -1;
  }
  const int fd = ::open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    std::cerr << "paratrain train: warning: cannot open PARATRAIN_TRIAL_SYNC " << path << " ("
              << std::strerror(errno) << "): epochs follow each other without the tuner's word"
              << std::endl;
    return -1;
  }
  // A byte already there answered an earlier process of this start (a rank 0 restarted by
  // --max-restarts while it waited): not this one's to act on.
  char stale[64];
  while (::read(fd, stale, sizeof(stale)) > 0) {
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

void wait_for_tuner(int fd) {
  char byte = 0;
  while (fd >= 0 && ::read(fd, &byte, 1) < 0 && errno == EINTR) {
  }
}

void report_epochs(Trainer& trainer,
                   const TrainSettings& s,
                   bool checkpoint_every_epoch,
                   const dist::ProcessGroupPtr& pg,
                   bool speak,
                   bool progress) {
  const bool json = s.json;
  const int epochs = s.epochs;
  const int64_t context = s.gpt ? s.gpt_options.context() : 0;
  // Every rank waits with rank 0 (which reads the tuner's word): none starts an epoch the tuner
  // may stop the job in.
  const bool synced = json && std::getenv("PARATRAIN_TRIAL_SYNC") != nullptr &&
                      *std::getenv("PARATRAIN_TRIAL_SYNC") != '\0';
  const int sync_fd = synced && speak ? open_tuner_sync() : -1;
  trainer.on_epoch_end([&trainer, json, checkpoint_every_epoch, pg, speak, progress, epochs,
                        context, synced, sync_fd](const EpochResult& r) {
    if (json && checkpoint_every_epoch) {
      // A reader of these rows (paratrain tune) may stop the job as soon as it sees one: the
      // epoch's checkpoint is on disk on every rank before the row is printed.
      trainer.wait_for_checkpoint();
      if (pg) {
        pg->barrier()->wait();
      }
    }
    if (speak) {
      if (progress) {
        std::printf("\n");
      }
      print_epoch(r, json, epochs, context);
    }
    if (synced && r.epoch + 1 < epochs) {
      wait_for_tuner(sync_fd);
      if (pg) {
        pg->barrier()->wait();
      }
    }
  });
}

// Trains, then writes the weights; a loss that is not finite or a diverged replica exits 1.
int fit_and_save(Trainer& trainer, const Args& args, const Placement& where, std::ostream& info) {
  try {
    trainer.fit();
  } catch (const NonFiniteLoss& e) {
    std::cerr << "paratrain train: " << e.what() << std::endl;
    return 1;
  } catch (const ReplicaDivergence& e) {
    std::cerr << "paratrain train: " << train_detail::in_flags(e.what()) << std::endl;
    return 1;
  }
  if (args.has("save-weights")) {
    const TensorMap weights = trainer.weights();  // on every rank: under fsdp a collective
    if (where.rank == 0) {
      save_safetensors(weights, args.get("save-weights"));
    }
  }
  if (args.has("save-weights") && where.rank == 0) {
    info << "paratrain train: weights written to " << args.get("save-weights") << std::endl;
  }
  if (where.pg) {
    where.pg->barrier()->wait();  // nobody leaves while rank 0 still writes
  }
  return 0;
}

}  // namespace

int run_train(const std::vector<std::string>& argv) {
  Args args(argv, train_detail::train_spec());
  if (args.has("help")) {
    std::cout << args.help();
    return 0;
  }
  const TrainSettings s = train_detail::read_settings(args);
  // Checked once, before any rank starts.
  TrainerOptions o = train_detail::loop_options(args, s);
  if (train_detail::becomes_launcher(s)) {
    return launch_ranks(args, argv, s.nproc, o);
  }

  if (args.get_int("max-restarts", 0) != 0) {
    throw UsageError(
        "--max-restarts goes with --strategy ddp or fsdp and --nproc-per-node N (or paratrain "
        "launch)");
  }
  Placement where;
  if (s.strategy == "ddp" || s.strategy == "fsdp") {
    where.pg = dist::init_process_group(dist::InitOptions()
                                            .backend(args.get("backend", "auto"))
                                            .uses_cuda(s.device_kind == "cuda"));
  }
  where.rank = where.pg ? where.pg->rank() : 0;
  where.world = where.pg ? where.pg->size() : 1;
  const bool speak = where.rank == 0;
  std::ostream& info = s.json ? std::cerr : std::cout;

  // Data first: a missing dataset should fail before any training is set up.
  const TrainData sets = load_data(s);
  where.device = s.device_kind == "cuda" ? dist::local_device() : torch::Device(torch::kCPU);

  torch::nn::Sequential model = build_model(args, s, sets.classes);
  const int64_t n_params = count_parameters(model);
  const std::vector<int64_t> balance =
      s.piped ? pipeline::balance_by_parameters(model, s.stages) : std::vector<int64_t>{};

  configure_run(o, args, s, where);
  try {
    Trainer trainer(model, sets.train, sets.test, o);
    install_fault(trainer, where.rank);
    if (speak) {
      print_setup(info, s, sets, n_params, balance, where, trainer, o);
    }
    const bool progress = speak && !s.json && ::isatty(1);
    if (progress) {
      show_progress(trainer, s.epochs);
    }
    report_epochs(trainer, s, o.checkpoint_every_epoch(), where.pg, speak, progress);
    return fit_and_save(trainer, args, where, info);
  } catch (const OptionError& e) {
    // The library names its options (a checkpoint directory of another run, every checkpoint
    // damaged); the command line has flags.
    throw std::runtime_error(train_detail::flag_message(e));
  }
}

}  // namespace cli
}  // namespace paratrain
