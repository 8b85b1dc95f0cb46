// paratrain bench offload: FSDP training of one GPT with Adam on 2 ranks, with everything in
// memory (fsdp), with Adam's moments in files (fsdp+offload-optimizer), and with the moments,
// gradients and shards in files (fsdp+offload-all); one process and one thread per rank. The GPT
// is built deferred (each unit written, sharded and offloaded in turn), so a model larger than
// memory starts.
//
// Rows: system, params, ranks, peak_rss_bytes (the largest rank's getrusage peak), disk_bytes
// (what the ranks' offload files hold, summed), step_seconds (median over the timed steps, the
// slowest rank's), io_wait_seconds (the median step's time spent waiting for the store: I/O the
// computation did not hide), compute_seconds (step - io_wait), tokens_per_rank, loss, first_loss;
// the offloaded rows also their overhead against the fsdp row. A "disk" row gives the offload
// directory's bandwidth, measured here as the store moves blocks (direct I/O: a write, then a
// read of 2 GiB), and T* = 4 F / BW, the tokens per rank per step from which the computation
// (F FLOP/s per rank, measured on the fsdp row as 6 x params x tokens per second) outlasts the
// optimizer's traffic (BW the bandwidth each rank gets), so that offloading can hide it.
//
// With --device cuda each rank trains on its own GPU over nccl and the offloaded optimizer is
// ZeRO-Offload's: Adam's moments in host memory (in --offload-dir's files when given), each step
// copying the shards and their gradients to the host, stepping them with the fused CPU Adam on
// the rank's share of the cores, and copying the shards back. The systems are fsdp and
// fsdp+offload-optimizer (FSDP's shards stay on the device). GPT-2's shape, on one GPU:
//   paratrain bench offload --device cuda --nproc-per-node 1 --layers 12 --width 768 --heads 12
//       --vocab 50257 --context 1024 --batch-size 8 --steps 10
//
// The headline, a GPT of 3.07 billion parameters on 2 ranks (none of whose weights, gradients or
// moments fit this machine's memory as fp32 Adam state):
//   paratrain bench offload --layers 39 --width 2560 --heads 20 --vocab 256 --context 128
//       --batch-size 2 --steps 4 --systems fsdp+offload-all --offload-dir /var/tmp

#include "bench_util.h"
#include "benchmarks.h"
#include "harness.h"

#include "paratrain/paratrain.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace paratrain {
namespace cli {

namespace {

using Clock = std::chrono::steady_clock;

const BenchSpec& offload_spec() {
  static const BenchSpec spec{
      "offload",
      "FSDP training of one GPT with everything in memory, with Adam's moments in files, and with "
      "moments, gradients and shards in files: memory, disk, step time and I/O wait per rank.",
      {
          {"layers", "N", "the GPT's blocks (default 12)", "2"},
          {"width", "N", "its width (default 768)", "32"},
          {"heads", "N", "its heads (default 12)", "2"},
          {"vocab", "N", "its vocabulary (default 256, byte tokens)", "64"},
          {"context", "N", "tokens per sequence (default 128)", "16"},
          {"batch-size,batch", "N", "sequences per rank (default 4)", "2"},
          {"steps", "N", "timed steps after one warm-up step (default 4)", "1"},
          {"systems", "LIST",
           "of fsdp, fsdp+offload-optimizer, fsdp+offload-all (default all three)"},
          {"offload-dir", "DIR",
           "a directory on the disk to measure (default /var/tmp; not tmpfs; with --device cuda, "
           "host memory unless given)"},
          {"nproc-per-node,ranks", "N", "ranks (default 2; with --device cuda, the visible GPUs)"},
          {"in-backward", "on|off",
           "fsdp+offload-optimizer: step each unit from its gradient hook, streaming its moments "
           "while backward goes on (default on; on a GPU the backward waits for each unit's step)"},
          {"device", "NAME",
           "cpu (default) or cuda: rank r on its node's cuda:r, the moments in host memory "
           "unless --offload-dir is given"},
          {"no-disk", "", "skip the disk's bandwidth row"},
          {"system", "S", kInternalOption},
      },
      "print JSON rows",
      /*workers=*/true};
  return spec;
}

models::GptOptions offload_shape(const Bench& bench) {
  return models::GptOptions()
      .layers(bench.get_int("layers", 12))
      .width(bench.get_int("width", 768))
      .heads(bench.get_int("heads", 12))
      .vocab(bench.get_int("vocab", 256))
      .context(bench.get_int("context", 128));
}

bool on_cuda(const Bench& bench) {
  return bench.get("device", "cpu") == "cuda";
}

// Where the store keeps the state: a directory on the disk; on a GPU, host memory ("") unless a
// directory is given.
std::string offload_dir(const Bench& bench) {
  return bench.get("offload-dir", on_cuda(bench) ? "" : "/var/tmp");
}

// On the CPU the ranks share the cores, one each; on a GPU the CPU runs the offloaded Adam, on
// this rank's share of the node's cores (as DeepSpeed's CPU Adam takes the cores it is given).
void set_offload_threads(const torch::Device& device) {
  const char* local = std::getenv("LOCAL_WORLD_SIZE");  // the launcher's ranks on this node
  const int ranks = std::max(1, local != nullptr ? std::atoi(local) : 1);
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  torch::set_num_threads(device.is_cpu() ? 1 : std::max(1, cores / ranks));
}

// The GPT in FSDP with `system`'s parts in `store`. On the CPU it is built deferred, each unit
// written, sharded and offloaded in turn; on a GPU it is built on the host and moved there whole.
std::unique_ptr<FullyShardedDataParallel> offload_fsdp(
    const Bench& bench,
    const dist::ProcessGroupPtr& pg,
    const torch::Device& device,
    const std::shared_ptr<optim::OffloadStore>& store) {
  const bool all = bench.get("system") == "fsdp+offload-all";
  torch::manual_seed(0);
  auto model = models::gpt(models::GptOptions(offload_shape(bench)).defer_init(device.is_cpu()));
  model->to(device);
  FsdpOptions options = FsdpOptions()
                            .units(models::gpt_block_names(model))
                            .activation_checkpointing(true)
                            .offload(FsdpOffloadPolicy().store(store).gradients(all).params(all));
  if (device.is_cpu()) {
    options.param_init_fn(models::gpt_init_weights);
  }
  return std::make_unique<FullyShardedDataParallel>(model, pg, options);
}

// The optimizer of `system`: the fused Adam, with its moments in `store` when there is one and,
// for fsdp+offload-optimizer with --in-backward on, each unit stepped from FSDP's gradient hook
// (its moments stream while backward goes on); on a GPU with the state there, libtorch's Adam on
// the device (the fused pass is the CPU's).
std::unique_ptr<torch::optim::Optimizer> offload_adam(
    const Bench& bench,
    FullyShardedDataParallel& fsdp,
    const torch::Device& device,
    const std::shared_ptr<optim::OffloadStore>& store) {
  const auto options = torch::optim::AdamOptions(3e-4);
  if (!device.is_cpu() && store == nullptr) {
    return std::make_unique<torch::optim::Adam>(fsdp.parameters(), options);
  }
  auto fused = std::make_unique<optim::FusedAdam>(fsdp.parameters(), options);
  fused->offload(store);
  if (bench.get("system") == "fsdp+offload-optimizer" && bench.get("in-backward", "on") == "on") {
    optim::FusedAdam* f = fused.get();
    fsdp.register_post_accumulate_grad_hook(
        [f](const torch::Tensor& shard) { f->step_parameter(shard); });
  }
  return fused;
}

// One rank's training, timed per step, with what the store waited and wrote.
int run_offload_worker(const Bench& bench) {
  const std::string system = bench.get("system");
  auto pg = dist::init_process_group();
  const torch::Device device = on_cuda(bench) ? dist::local_device() : torch::Device(torch::kCPU);
  set_offload_threads(device);
  const models::GptOptions shape = offload_shape(bench);
  std::shared_ptr<optim::OffloadStore> store;
  if (system != "fsdp") {
    store = std::make_shared<optim::OffloadStore>(optim::OffloadOptions()
                                                      .dir(offload_dir(bench))
                                                      .owner("rank " + std::to_string(pg->rank())));
  }
  auto wrapped = offload_fsdp(bench, pg, device, store);
  FullyShardedDataParallel& fsdp = *wrapped;
  std::unique_ptr<torch::optim::Optimizer> adam = offload_adam(bench, fsdp, device, store);
  torch::optim::Optimizer& opt = *adam;
  const int batch = bench.get_int("batch-size", 4);
  const int steps = bench.get_int("steps", 4);
  torch::manual_seed(100 + pg->rank());
  torch::Tensor tokens = torch::randint(0, shape.vocab(), {batch, shape.context() + 1}).to(device);
  torch::Tensor x = tokens.narrow(1, 0, shape.context()), y = tokens.narrow(1, 1, shape.context());
  std::vector<double> times, waits;
  double loss = 0, first = 0;
  for (int step = 0; step <= steps; ++step) {
    pg->barrier()->wait();
    const double waited = store ? store->io_wait_seconds() : 0;
    const auto t0 = Clock::now();
    opt.zero_grad();
    fsdp.discard_offloaded_gradients();
    auto l = torch::nn::functional::cross_entropy(fsdp.forward(x).flatten(0, 1), y.flatten());
    l.backward();
    opt.step();
    loss = l.item<double>();  // on a GPU, waits for the step
    first = step == 0 ? loss : first;
    if (step > 0) {
      times.push_back(seconds_since(t0));
      waits.push_back(store ? store->io_wait_seconds() - waited : 0);
    }
    bench.progress("  " + system + " step " + std::to_string(step) + ": loss " +
                   std::to_string(loss) + ", " + std::to_string(seconds_since(t0)) + " s");
  }
  const double step_seconds = median(times), io_wait = median(waits);
  // On the device: where the group moves tensors (nccl: only CUDA ones).
  at::Tensor t =
      torch::tensor({step_seconds, static_cast<double>(peak_rss_bytes()), io_wait}, torch::kDouble)
          .to(device);
  pg->allreduce(t, dist::ReduceOp::kMax)->wait();
  t = t.cpu();
  at::Tensor disk =
      torch::tensor({static_cast<double>(store && store->on_disk() ? store->stored_bytes() : 0)},
                    torch::kDouble)
          .to(device);
  pg->allreduce(disk, dist::ReduceOp::kSum)->wait();
  disk = disk.cpu();
  if (pg->rank() == 0) {
    append_row(bench.get("out"), {{"system", system},
                                  {"params", models::gpt_parameter_count(shape)},
                                  {"ranks", pg->size()},
                                  {"device", device.is_cpu() ? "cpu" : "cuda"},
                                  {"peak_rss_bytes", static_cast<int64_t>(t[1].item<double>())},
                                  {"disk_bytes", static_cast<int64_t>(disk[0].item<double>())},
                                  {"step_seconds", t[0].item<double>()},
                                  {"io_wait_seconds", t[2].item<double>()},
                                  {"compute_seconds", t[0].item<double>() - t[2].item<double>()},
                                  {"tokens_per_rank", batch * shape.context()},
                                  {"first_loss", first},
                                  {"loss", loss},
                                  {"steps", steps}});
  }
  return 0;
}

// The offload directory's bandwidth as the store sees it: 2 GiB written in blocks of 256 MiB,
// then read back (direct I/O, checksums included).
JsonRow disk_row(const Bench& bench) {
  optim::OffloadStore store(optim::OffloadOptions().dir(offload_dir(bench)).owner("bench"));
  const int64_t block = bench.smoke() ? (1 << 20) : (256 << 20), blocks = 8;
  torch::Tensor buffer = optim::OffloadStore::buffer(block / 4, torch::kFloat);
  buffer.uniform_();
  for (int64_t b = 0; b < blocks; ++b) {
    store.reserve(std::to_string(b), block);
  }
  auto time_all = [&](bool write) {
    const auto t0 = Clock::now();
    for (int64_t b = 0; b < blocks; ++b) {
      store.wait(write ? store.write(std::to_string(b), buffer.data_ptr())
                       : store.read(std::to_string(b), buffer.data_ptr()));
    }
    return seconds_since(t0);
  };
  const double write = time_all(true), read = time_all(false);
  const double bytes = static_cast<double>(block * blocks);
  return {{"system", "disk"},
          {"dir", offload_dir(bench)},
          {"direct_io", store.on_disk()},
          {"bytes", static_cast<int64_t>(bytes)},
          {"write_bytes_per_second", bytes / write},
          {"read_bytes_per_second", bytes / read},
          {"bytes_per_second", 2 * bytes / (write + read)}};
}

// Each offloaded row's overhead against the fsdp row, and T* from the fsdp row's FLOP/s and the
// disk's bandwidth shared by the ranks.
void add_offload_ratios(std::vector<JsonRow>& rows) {
  const JsonRow* memory = nullptr;
  const JsonRow* disk = nullptr;
  for (const auto& row : rows) {
    const std::string system = string_field(row, "system");
    memory = system == "fsdp" && row.contains("step_seconds") ? &row : memory;
    disk = system == "disk" ? &row : disk;
  }
  std::vector<JsonRow> out = rows;
  for (auto& row : out) {
    const std::string system = string_field(row, "system");
    if (memory != nullptr && row.contains("step_seconds") && system != "fsdp") {
      row["overhead"] =
          number_field(row, "step_seconds") / number_field(*memory, "step_seconds") - 1;
    }
    if (memory != nullptr && disk != nullptr && system == "disk") {
      const double flops = 6 * number_field(*memory, "params") *
                           number_field(*memory, "tokens_per_rank") /
                           number_field(*memory, "compute_seconds");
      const double per_rank =
          number_field(row, "bytes_per_second") / number_field(*memory, "ranks");
      row["flops_per_second_per_rank"] = flops;
      row["bytes_per_second_per_rank"] = per_rank;
      row["t_star_tokens_per_rank"] = 4 * flops / per_rank;
    }
  }
  rows = out;
}

void print_offload_rows(const Bench& bench, std::vector<JsonRow> rows) {
  add_offload_ratios(rows);
  if (bench.json()) {
    for (const auto& row : rows) {
      print_row(row);
    }
    return;
  }
  const double gib = 1 << 30;
  for (const auto& row : rows) {
    const std::string system = string_field(row, "system");
    if (system == "disk") {
      std::cout << "disk " << string_field(row, "dir") << ": write "
                << number_field(row, "write_bytes_per_second") / 1e9 << " GB/s, read "
                << number_field(row, "read_bytes_per_second") / 1e9 << " GB/s";
      if (row.contains("t_star_tokens_per_rank")) {
        std::cout << "; T* = " << number_field(row, "t_star_tokens_per_rank")
                  << " tokens per rank per step";
      }
      std::cout << "\n";
      continue;
    }
    std::cout << std::left << std::setw(24) << system;
    if (row.contains("error")) {
      std::cout << "failed: " << string_field(row, "error") << "\n";
      continue;
    }
    std::cout << std::fixed << std::setprecision(2) << number_field(row, "params") / 1e9
              << "B params, peak " << number_field(row, "peak_rss_bytes") / gib
              << " GiB/rank, disk " << number_field(row, "disk_bytes") / gib << " GiB, step "
              << std::setprecision(3) << number_field(row, "step_seconds") << " s (I/O wait "
              << number_field(row, "io_wait_seconds") << " s), loss "
              << number_field(row, "first_loss") << " -> " << number_field(row, "loss");
    if (row.contains("overhead")) {
      std::cout << ", overhead " << std::setprecision(1) << 100 * number_field(row, "overhead")
                << "%";
    }
    std::cout << "\n";
  }
  std::cout.flush();
}

int run_offload_bench(const Bench& bench) {
  const std::string device = bench.get("device", "cpu");
  require(device == "cpu" || device == "cuda",
          "unknown --device '" + device + "': choose cpu or cuda");
  require(device == "cpu" || torch::cuda::is_available(),
          "--device cuda: this process sees no CUDA device (or its libtorch has no CUDA): run it "
          "where one is, or use --device cpu");
  const std::vector<std::string> systems = split_list(
      bench.get("systems", on_cuda(bench) ? "fsdp,fsdp+offload-optimizer"
                                          : "fsdp,fsdp+offload-optimizer,fsdp+offload-all"));
  for (const auto& system : systems) {
    require(system == "fsdp" || system == "fsdp+offload-optimizer" || system == "fsdp+offload-all",
            "unknown system '" + system +
                "' in --systems: choose of fsdp, fsdp+offload-optimizer, fsdp+offload-all");
    require(!on_cuda(bench) || system != "fsdp+offload-all",
            "fsdp+offload-all offloads the shards and their gradients, which stay on the device "
            "with --device cuda: choose fsdp and fsdp+offload-optimizer");
  }
  const std::string dir = offload_dir(bench);
  const std::string problem = dir.empty() ? "" : optim::offload_dir_problem(dir);
  require(problem.empty(), problem);
  const int ranks = bench.get_int(
      "nproc-per-node",
      on_cuda(bench) ? std::max<int>(1, static_cast<int>(torch::cuda::device_count())) : 2);
  require(ranks >= 1, "--nproc-per-node must be at least 1");
  const std::string out = results_file("offload");
  std::vector<JsonRow> rows;
  if (!bench.has("no-disk") && !dir.empty()) {
    rows.push_back(disk_row(bench));
  }
  for (const auto& system : systems) {
    bench.progress("measuring " + system + "...");
    std::remove(out.c_str());
    std::vector<std::string> extra{"--system", system};
    for (const auto& word :
         bench.forwarded({"layers", "width", "heads", "vocab", "context", "batch-size", "steps",
                          "offload-dir", "in-backward", "device"})) {
      extra.push_back(word);
    }
    run_bench_job(bench.worker_command(out, extra), ranks, on_cuda(bench) ? "nccl" : "gloo", out);
    rows.push_back(read_rows(out).at(0));
  }
  std::remove(out.c_str());
  print_offload_rows(bench, rows);
  return 0;
}

}  // namespace

int run_bench_offload(const std::vector<std::string>& argv) {
  return run_benchmark(offload_spec(), argv, run_offload_bench, run_offload_worker);
}

}  // namespace cli
}  // namespace paratrain
