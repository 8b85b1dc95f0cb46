// paratrain train: train a model on a real dataset, on one process or with DDP over several.

#include "args.h"
#include "commands.h"

#include "paratrain/paratrain.h"

#include <torch/torch.h>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iomanip>
#include <iostream>
#include <sstream>

namespace paratrain {
namespace cli {

namespace {

const char* kTrainUsage =
    "usage: paratrain train --model linear|mlp|cnn|resnet18..152[_cifar]\n"
    "         --dataset fashion-mnist|imagefolder [--data-dir D]\n"
    "         --strategy single|ddp|dp|pipeline [--nproc N] [--backend auto|gloo|mpi]\n"
    "         [--device cpu|cuda] [--devices cpu,cpu] [--stages P --chunks M\n"
    "         --schedule gpipe|1f1b] --epochs E\n"
    "         [--steps S] --batch-size B [--amp O0|O1|O2|O3 [--amp-dtype bf16|fp16]]\n"
    "         [--image-size N] [--channels C] [--head custom] [--freeze-backbone]\n"
    "         [--lr L] [--momentum M] [--weight-decay W] [--seed S] [--workers K]\n"
    "         [--data-dir D] [--save-weights F.safetensors] [--load-weights F.safetensors] "
    "[--json]\n"
    "\n"
    "--dataset imagefolder reads D/train and D/val as torchvision's ImageFolder (JPEG, PNG,\n"
    "WebP), training on RandomResizedCrop(--image-size) + horizontal flips and validating on\n"
    "Resize(size * 8 / 7) + CenterCrop(size), normalized with ImageNet's mean and std; --workers\n"
    "threads decode (0 decodes in the training thread).\n"
    "--batch-size is per rank (ddp) or the whole batch, scattered over --devices (dp, as\n"
    "nn.DataParallel) or cut into --chunks micro-batches flowing through --stages stages\n"
    "(pipeline; one thread per stage, on --devices or the CPU). --steps caps the steps of each\n"
    "epoch. With --strategy ddp, --nproc N starts N ranks through the launcher; under\n"
    "`paratrain launch` or mpirun it joins the job. --device: single and ddp compute on\n"
    "cuda:LOCAL_RANK when CUDA is available (cuda), else on the CPU; --device cpu keeps them on\n"
    "the CPU on a machine with GPUs.\n";

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

}  // namespace

int run_train(const std::vector<std::string>& argv) {
  Args args(argv,
            {"model",   "dataset",    "strategy",     "nproc",        "backend",      "epochs",
             "steps",   "batch-size", "lr",           "momentum",     "weight-decay", "seed",
             "workers", "data-dir",   "save-weights", "load-weights", "devices",      "stages",
             "chunks",  "schedule",   "amp",          "amp-dtype",    "image-size",   "channels",
             "head",    "device"},
            {"json", "help", "freeze-backbone"});
  if (args.has("help")) {
    std::cout << kTrainUsage;
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

  // ddp with --nproc outside a job: become the launcher of N copies of this command.
  if (strategy == "ddp" && nproc > 0 && !inside_a_job()) {
    std::vector<std::string> command{self_path(), "train"};
    for (size_t i = 0; i < argv.size(); ++i) {
      if (argv[i] == "--nproc") {
        ++i;
        continue;
      }
      if (argv[i].rfind("--nproc=", 0) == 0) {
        continue;
      }
      command.push_back(argv[i]);
    }
    dist::LaunchOptions o;
    o.nproc_per_node(nproc).standalone(true).command(command).prefix_output(false).name(
        "paratrain train");
    const std::string backend = args.get("backend", "auto");
    if (backend != "auto") {
      o.backend(backend).mpi_shim({self_path(), "launch", "--from-mpirun", "--no-prefix"});
    }
    dist::LaunchResult r = dist::launch(o);
    if (!r.summary.empty()) {
      std::cerr << r.summary << std::endl;
    }
    return r.exit_code;
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
  torch::Device device = device_kind == "cuda" ? dist::local_device() : torch::Device(torch::kCPU);

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
  if (!dp_devices.empty()) {
    device = dp_devices[0];  // the module lives on the first device, as with nn.DataParallel
  }
  if (piped) {
    device = stage_devices[0];  // the pipeline moves each stage to its own device
  }
  model->to(device);
  // Mixed precision before any wrapper: DDP then buckets the model's (possibly half) gradients.
  amp::MixedPrecision mp(model, device, amp_options);
  std::unique_ptr<DistributedDataParallel> ddp;
  if (pg) {
    ddp = std::make_unique<DistributedDataParallel>(model, pg);
    mp.sync_masters();  // DDP broadcast rank 0's weights into the model
  }
  std::unique_ptr<DataParallel> dp;
  if (!dp_devices.empty()) {
    dp = std::make_unique<DataParallel>(model, dp_devices);
  }
  std::unique_ptr<pipeline::Pipeline> pipe;
  if (piped) {
    pipe = std::make_unique<pipeline::Pipeline>(
        model, pipeline::balance_by_parameters(model, stages), stage_devices,
        [&mp](const torch::Tensor& out, const torch::Tensor& target) {
          return mp.scaler().scale(
              torch::nn::functional::cross_entropy(mp.cast_output(out), target));
        },
        pipeline::PipelineOptions().chunks(chunks).schedule(schedule));
    device = stage_devices.back();  // where the loss and outputs are
  }
  torch::optim::SGD optimizer(
      mp.optimizer_parameters(),
      torch::optim::SGDOptions(lr).momentum(momentum).weight_decay(weight_decay));

  auto sampler = std::make_shared<data::DistributedSampler>(
      sets.train->size(), world, rank, /*shuffle=*/true, static_cast<uint64_t>(seed));
  data::DataLoader loader(sets.train,
                          data::LoaderOptions(static_cast<size_t>(batch_size))
                              .workers(workers)
                              .pin_memory(device.is_cuda())
                              .seed(static_cast<uint64_t>(seed))
                              .persistent_workers(true),
                          sampler);
  // Each rank validates a contiguous share of the validation set.
  const size_t n_test = sets.test->size();
  std::vector<size_t> share;
  for (size_t i = n_test * static_cast<size_t>(rank) / static_cast<size_t>(world);
       i < n_test * static_cast<size_t>(rank + 1) / static_cast<size_t>(world); ++i) {
    share.push_back(i);
  }
  data::DataLoader test_loader(
      sets.test,
      data::LoaderOptions(dataset == "fashion-mnist" ? 1000 : static_cast<size_t>(batch_size))
          .workers(workers)
          .persistent_workers(true),
      std::make_shared<data::FixedSampler>(std::move(share)));
  const size_t steps_per_epoch =
      std::min<size_t>(steps > 0 ? static_cast<size_t>(steps) : SIZE_MAX,
                       (sampler->num_samples() + batch_size - 1) / batch_size);
  if (speak) {
    info << "paratrain train: model " << model_name << " (" <<
        [&] {
          int64_t n = 0;
          for (const auto& p : model->parameters()) {
            n += p.numel();
          }
          return n;
        }()
         << " parameters), dataset " << dataset << " (" << sets.train->size() << " train, "
         << sets.test->size() << " test, " << sets.classes << " classes), strategy " << strategy
         << ", " << world << " rank" << (world == 1 ? "" : "s")
         << (pg ? " (" + pg->backend_name() + ")" : "") << ", device" <<
        [&] {
          std::ostringstream d;
          const auto& list = piped ? stage_devices : dp_devices;
          if (list.empty()) {
            d << " " << device;
          }
          for (size_t i = 0; i < list.size(); ++i) {
            d << (i == 0 ? "s " : ",") << list[i];
          }
          if (pipe) {
            d << " (" << stages << " stages, balance "
              << c10::IntArrayRef(pipeline::balance_by_parameters(model, stages)) << ", " << chunks
              << " chunks, " << pipeline::to_string(schedule) << ")";
          }
          return d.str();
        }()
         << ", batch " << batch_size
         << (dp     ? " (whole, scattered), "
             : pipe ? " (whole, micro-batched), "
                    : " per rank, ")
         << steps_per_epoch << " steps per epoch, lr " << lr << ", momentum " << momentum
         << ", weight decay " << weight_decay << ", seed " << seed << ", " << at::get_num_threads()
         << " threads per rank"
         << (mp.opt_level() == amp::OptLevel::kO0
                 ? std::string()
                 : ", amp " + amp::to_string(mp.opt_level()) + " (" +
                       (mp.dtype() == torch::kBFloat16 ? "bf16" : "fp16") +
                       (mp.loss_scaling() ? ", dynamic loss scaling" : "") + ")")
         << std::endl;
  }
  const bool progress = speak && !json && ::isatty(1);

  for (int epoch = 0; epoch < epochs; ++epoch) {
    model->train();
    loader.set_epoch(static_cast<uint64_t>(epoch));  // the sampler's set_epoch
    loader.reset_stats();
    // Batches are resized on the device, one batch ahead, on a side stream (DevicePrefetcher).
    data::DevicePrefetcher batches(loader, device, [&](const torch::Tensor& images) {
      return data::adapt_images(images, image_size, channels);
    });
    // Summed on the device: reading the loss every step would make the host wait for the device.
    torch::Tensor loss_sum = torch::zeros({}, torch::TensorOptions(torch::kDouble).device(device));
    int64_t samples = 0;
    auto start = Clock::now();
    for (size_t step = 0; step < steps_per_epoch; ++step) {
      auto batch = batches.next();
      if (!batch) {
        break;
      }
      auto x = batch->data;
      auto y = batch->target;
      optimizer.zero_grad();
      torch::Tensor loss;
      {
        auto autocast = mp.autocast();  // O1 only; its threads (dp, pipeline) inherit it
        x = mp.cast_input(x);
        if (pipe) {
          // Forward and backward of every micro-batch (the loss function scales when on).
          loss = pipe->step(x, y) / mp.scaler().get_scale();
        } else {
          auto out = ddp ? ddp->forward(x) : dp ? dp->forward(x) : model->forward(x);
          loss = torch::nn::functional::cross_entropy(mp.cast_output(out), y);
        }
      }
      if (!pipe) {
        mp.backward(loss);
      }
      mp.step(optimizer);
      loss_sum += loss.detach().sum().to(loss_sum.device(), torch::kDouble) *
                  static_cast<double>(y.size(0));
      samples += y.size(0);
      if (progress && (step % 10 == 0 || step + 1 == steps_per_epoch)) {
        const int width = 30;
        int filled = static_cast<int>(width * (step + 1) / steps_per_epoch);
        std::printf("\repoch %d/%d [%s%s] %zu/%zu loss %.4f", epoch + 1, epochs,
                    std::string(static_cast<size_t>(filled), '=').c_str(),
                    std::string(static_cast<size_t>(width - filled), ' ').c_str(), step + 1,
                    steps_per_epoch, loss_sum.item<double>() / std::max<int64_t>(1, samples));
        std::fflush(stdout);
      }
    }
    if (device.is_cuda()) {
      loss_sum.item<double>();  // the epoch's time includes its last step's device work
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();

    // Test accuracy over the whole test set: each rank takes a contiguous share.
    model->eval();
    int64_t correct = 0;
    int64_t seen = 0;
    const double data_wait = loader.stats().wait_seconds;
    {
      torch::NoGradGuard no_grad;
      test_loader.set_epoch(0);
      while (auto batch = test_loader.next()) {
        auto images =
            mp.cast_input(data::adapt_images(batch->data.to(device), image_size, channels));
        auto autocast = mp.autocast();
        auto out = pipe ? pipe->forward(images) : model->forward(images.to(device));
        correct += out.argmax(1).eq(batch->target.to(out.device())).sum().item<int64_t>();
        seen += batch->target.size(0);
      }
    }
    at::Tensor totals = torch::tensor({loss_sum.item<double>(), static_cast<double>(samples),
                                       static_cast<double>(correct), static_cast<double>(seen)},
                                      torch::kDouble)
                            .to(device);
    if (pg) {
      pg->allreduce(totals)->wait();
    }
    totals = totals.cpu();
    const double train_loss = totals[0].item<double>() / std::max(1.0, totals[1].item<double>());
    const double accuracy = totals[2].item<double>() / std::max(1.0, totals[3].item<double>());
    const double images_per_sec = totals[1].item<double>() / seconds;
    if (speak) {
      if (progress) {
        std::printf("\n");
      }
      if (json) {
        std::cout << std::setprecision(6) << "{\"epoch\": " << epoch + 1
                  << ", \"train_loss\": " << train_loss << ", \"test_accuracy\": " << accuracy
                  << ", \"images_per_sec\": " << images_per_sec << ", \"seconds\": " << seconds
                  << ", \"data_wait_seconds\": " << data_wait << "}" << std::endl;
      } else {
        std::cout << std::fixed << std::setprecision(4) << "epoch " << epoch + 1 << "/" << epochs
                  << ": train_loss " << train_loss << ", test_accuracy " << accuracy
                  << ", images/s " << std::setprecision(0) << images_per_sec << " ("
                  << std::setprecision(1) << seconds << " s, " << data_wait
                  << " s waiting for data)" << std::endl;
      }
    }
  }
  if (args.has("save-weights") && speak) {
    auto state = module_state(*model);
    if (mp.opt_level() == amp::OptLevel::kO2) {
      // The fp32 masters, not the model's half copy: masters() follows parameters() with tied
      // weights once.
      std::vector<torch::Tensor> unique;
      for (const auto& p : model->named_parameters()) {
        size_t i = 0;
        while (i < unique.size() && !unique[i].is_same(p.value())) {
          ++i;
        }
        if (i == unique.size()) {
          unique.push_back(p.value());
        }
        state[p.key()] = mp.masters()[i].detach();
      }
    }
    save_safetensors(state, args.get("save-weights"));
    info << "paratrain train: weights written to " << args.get("save-weights") << std::endl;
  }
  if (pg) {
    pg->barrier()->wait();  // nobody leaves while rank 0 still writes
  }
  return 0;
}

}  // namespace cli
}  // namespace paratrain
