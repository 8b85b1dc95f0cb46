// paratrain bench parallel: one GPT trained with Adam on device meshes of 4 ranks (tensor
// parallel, with and without sequence parallel, with FSDP across): step time, memory, the bytes
// each rank sends per step, and the live activations at the end of the forward.
//
// Rows: mesh (tp4, tp4+sp, tp2,fsdp2, ...), params, ranks, peak_rss_bytes (the largest rank's),
// step_seconds (median over the timed steps, the slowest rank's), loss (the last step's),
// bytes_sent (per rank per step over the tensor-parallel group, as ProcessGroup::bytes_sent counts
// them), dp_bytes_sent (the same over dp_shard: FSDP's), bytes_formula (what Megatron-LM's
// formula gives for the same shape: see megatron_bytes), bytes_ratio (bytes_sent over it), and
// activation_bytes (the largest rank's live tensor bytes that the forward added: what backward
// keeps, the logits included), block_activation_bytes (the same from the first block's input to
// the last block's output: the transformer blocks' own, which Korthikanti et al.'s per-layer
// formula counts; under FSDP it includes the next unit's prefetched weights).
//
//   paratrain bench parallel --json       (gpt2-medium's width, 4 blocks, context 256, 4 ranks)

#include "bench_util.h"
#include "benchmarks.h"
#include "harness.h"
#include "tensor_memory.h"

#include "paratrain/paratrain.h"

#include <torch/torch.h>

#include <iomanip>
#include <iostream>
#include <sstream>

namespace paratrain {
namespace cli {

namespace {

using Clock = std::chrono::steady_clock;

const BenchSpec& parallel_spec() {
  static const BenchSpec spec{
      "parallel",
      "A GPT on device meshes (tensor, sequence and fully sharded data parallel): step time, "
      "memory, bytes sent per rank against Megatron-LM's formula, live activations.",
      {
          {"meshes", "LIST",
           "space-separated meshes of tpN[+sp][+lp], fsdpN and replicateN joined by commas "
           "(default \"tp4+lp tp4+sp+lp tp2+lp,fsdp2 tp2+sp+lp,fsdp2 fsdp4\"); +sp: sequence "
           "parallel, +lp: "
           "loss parallel",
           "tp2 tp2+sp+lp fsdp2"},
          {"layers", "N", "transformer blocks (default 4)", "1"},
          {"width", "N", "(default 1024, gpt2-medium's)", "32"},
          {"heads", "N", "(default 16)", "4"},
          {"vocab", "N",
           "(default 50304: GPT-2's 50257 padded to a multiple of 64, as nanoGPT and Megatron-LM "
           "pad it, so that tp divides it)",
           "64"},
          {"context", "N", "tokens per sequence (default 256)", "16"},
          {"batch-size,batch", "N", "sequences per data-parallel rank (default 1)", "1"},
          {"steps", "N", "timed steps after one warm-up step (default 3)", "1"},
          {"nproc-per-node,ranks", "N", "ranks (default 4)", "2"},
          {"mesh", "M", kInternalOption},
      },
      "print JSON rows",
      /*workers=*/true};
  return spec;
}

struct MeshSpec {
  int tp = 1, shard = 1, replicate = 1;
  bool sp = false, lp = false;
};

MeshSpec parse_mesh(const std::string& text) {
  MeshSpec m;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, ',');) {
    std::vector<std::string> words;
    std::stringstream w(part);
    for (std::string word; std::getline(w, word, '+');) {
      words.push_back(word);
    }
    require(!words.empty(), "mesh '" + text + "': an empty part");
    auto degree = [&](const std::string& prefix) {
      const std::string digits = words[0].substr(prefix.size());
      require(!digits.empty() && digits.find_first_not_of("0123456789") == std::string::npos,
              "mesh '" + text + "': '" + words[0] + "' needs a degree, as " + prefix + "2");
      return std::stoi(digits);
    };
    if (words[0].rfind("tp", 0) == 0) {
      m.tp = degree("tp");
    } else if (words[0].rfind("fsdp", 0) == 0) {
      m.shard = degree("fsdp");
    } else if (words[0].rfind("replicate", 0) == 0) {
      m.replicate = degree("replicate");
    } else {
      require(false, "mesh '" + text + "': unknown part '" + words[0] +
                         "'; use tpN[+sp][+lp], fsdpN or replicateN");
    }
    for (size_t i = 1; i < words.size(); ++i) {
      require(words[0].rfind("tp", 0) == 0 && (words[i] == "sp" || words[i] == "lp"),
              "mesh '" + text + "': '+" + words[i] + "' is not +sp or +lp after tpN");
      (words[i] == "sp" ? m.sp : m.lp) = true;
    }
  }
  return m;
}

models::GptOptions bench_shape(const Bench& bench) {
  return models::GptOptions()
      .layers(bench.get_int("layers", 4))
      .width(bench.get_int("width", 1024))
      .heads(bench.get_int("heads", 16))
      .vocab(bench.get_int("vocab", 50304))
      .context(bench.get_int("context", 256));
}

// Megatron-LM's bytes per rank per step for tensor parallelism over t ranks (Korthikanti et al.,
// 2022, section 4.2.2): each block all-reduces its activations (b x s x h, fp32 here) twice in
// forward and twice in backward, a ring sending 2(t-1)/t of each. Sequence parallelism replaces
// every all-reduce by an all-gather and a reduce-scatter, (t-1)/t each, the same bytes; and, as
// Megatron-LM's sequence-parallel layers do, the two layers that gather their input (c_attn,
// c_fc) gather it again in backward instead of keeping it: two more all-gathers per block.
// To the blocks' term this adds, as the plan runs them: the embedding's all-reduce (forward) and
// the head's input (its backward all-reduce; under sequence parallelism an all-gather and a
// reduce-scatter, and the embedding output's all-gather in backward); the logits' all-gather
// ((t-1)/t of b x s x vocab) without loss parallel, or loss parallel's three all-reduces of b x s.
// What the formula leaves out: the O(width) gradient sums of the LayerNorms and biases that
// sequence parallelism splits.
double megatron_bytes(const models::GptOptions& o, const MeshSpec& m, int64_t batch) {
  const double t = m.tp, f = (t - 1) / t;
  const double activations = 4.0 * static_cast<double>(batch * o.context() * o.width());
  const double per_block = m.sp ? (4 + 4 + 2) * f * activations : 4 * 2 * f * activations;
  const double blocks = static_cast<double>(o.layers()) * per_block;
  double ends = 2 * f * activations + 2 * f * activations;  // embedding, head input
  if (m.sp) {
    ends = 2 * f * activations + f * activations + 2 * f * activations;
  }
  const double tokens = static_cast<double>(batch * o.context());
  const double logits = m.lp ? 3 * 2 * f * 4 * tokens : f * 4 * tokens * o.vocab();
  return blocks + ends + logits;
}

struct MeshRun {
  std::unique_ptr<DeviceMesh> mesh;
  torch::nn::Sequential model;
  std::unique_ptr<FullyShardedDataParallel> fsdp;
  std::unique_ptr<torch::optim::Adam> opt;
  torch::Tensor forward(const torch::Tensor& x) {
    return fsdp ? fsdp->forward(x) : model->forward(x);
  }
  int64_t sent(const std::string& dim) const {
    return mesh->has(dim) ? (*mesh)[dim]->bytes_sent() : 0;
  }
};

MeshRun build_mesh(const models::GptOptions& shape,
                   const MeshSpec& m,
                   const dist::ProcessGroupPtr& pg) {
  MeshRun run;
  run.mesh = std::make_unique<DeviceMesh>(pg, mesh_dims(pg->size(), m.replicate, m.shard, m.tp, 1));
  torch::manual_seed(0);
  run.model = models::gpt(shape);
  if (m.tp > 1) {
    parallelize_module(
        run.model.ptr(), (*run.mesh)["tp"],
        models::gpt_parallelize_plan(
            run.model, m.tp,
            models::GptParallelOptions().sequence_parallel(m.sp).loss_parallel(m.lp)));
  }
  std::vector<torch::Tensor> params = run.model->parameters();
  if (m.shard > 1) {
    run.fsdp = std::make_unique<FullyShardedDataParallel>(
        run.model, (*run.mesh)["dp_shard"],
        FsdpOptions()
            .units(models::gpt_block_names(run.model))
            .replicate_group(m.replicate > 1 ? (*run.mesh)["dp_replicate"] : nullptr));
    params = run.fsdp->parameters();
  }
  run.opt = std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(3e-4));
  return run;
}

struct StepTotals {
  std::vector<double> times;
  double tp_bytes = 0, dp_bytes = 0, activations = 0, block_activations = 0, loss = 0;
};

// Live tensor bytes when the first block starts and when the last one ends, by forward hooks.
struct BlockSpan {
  std::shared_ptr<int64_t> start = std::make_shared<int64_t>(0);
  std::shared_ptr<int64_t> end = std::make_shared<int64_t>(0);
};

BlockSpan watch_blocks(const torch::nn::Sequential& model, std::shared_ptr<ReplicaMemory> memory) {
  BlockSpan span;
  const auto blocks = models::gpt_block_names(model);
  const auto children = model->named_children();
  register_forward_pre_hook(*children[blocks.front()], [span, memory](const torch::Tensor& x) {
    *span.start = memory->currents()[0];
    return x;
  });
  register_forward_hook(*children[blocks.back()], [span, memory](const torch::Tensor& y) {
    *span.end = memory->currents()[0];
    return y;
  });
  return span;
}

void timed_step(MeshRun& run,
                const MeshSpec& m,
                ReplicaMemory& memory,
                const BlockSpan& blocks,
                const torch::Tensor& x,
                const torch::Tensor& y,
                StepTotals& totals,
                bool timed) {
  const int64_t tp0 = run.sent("tp"), dp0 = run.sent("dp_shard") + run.sent("dp_replicate");
  run.mesh->world()->barrier()->wait();
  const auto t0 = Clock::now();
  run.opt->zero_grad();
  const int64_t before = memory.currents()[0];
  const torch::Tensor logits = run.forward(x);
  const double activations = static_cast<double>(memory.currents()[0] - before);
  const torch::Tensor loss =
      m.lp ? loss_parallel_cross_entropy(logits, y, (*run.mesh)["tp"])
           : torch::nn::functional::cross_entropy(logits.flatten(0, 1), y.flatten());
  loss.backward();
  run.opt->step();
  totals.loss = loss.item<double>();
  if (timed) {
    totals.times.push_back(seconds_since(t0));
    totals.tp_bytes += static_cast<double>(run.sent("tp") - tp0);
    totals.dp_bytes += static_cast<double>(run.sent("dp_shard") + run.sent("dp_replicate") - dp0);
    totals.activations = std::max(totals.activations, activations);
    totals.block_activations =
        std::max(totals.block_activations, static_cast<double>(*blocks.end - *blocks.start));
  }
}

int run_parallel_worker(const Bench& bench) {
  torch::set_num_threads(1);
  auto memory = std::make_shared<ReplicaMemory>(1);
  c10::DebugInfoGuard track(c10::DebugInfoKind::PROFILER_STATE, memory);
  auto pg = dist::init_process_group();
  const models::GptOptions shape = bench_shape(bench);
  const MeshSpec m = parse_mesh(bench.get("mesh"));
  MeshRun run = build_mesh(shape, m, pg);
  const BlockSpan blocks = watch_blocks(run.model, memory);
  const int batch = bench.get_int("batch-size", 1), steps = bench.get_int("steps", 3);
  // Every rank of a tp group takes its data-parallel rank's batch.
  torch::manual_seed(100 + run.mesh->local_rank("dp"));
  const torch::Tensor tokens = torch::randint(0, shape.vocab(), {batch, shape.context() + 1});
  const torch::Tensor x = tokens.narrow(1, 0, shape.context()),
                      y = tokens.narrow(1, 1, shape.context());
  StepTotals totals;
  for (int step = 0; step <= steps; ++step) {
    timed_step(run, m, *memory, blocks, x, y, totals, step > 0);
    bench.progress("  " + bench.get("mesh") + " step " + std::to_string(step) + ": loss " +
                   std::to_string(totals.loss));
  }
  at::Tensor t = torch::tensor(
      {median(totals.times), static_cast<double>(peak_rss_bytes()), totals.tp_bytes / steps,
       totals.dp_bytes / steps, totals.activations, totals.block_activations},
      torch::kDouble);
  pg->allreduce(t, dist::ReduceOp::kMax)->wait();
  if (pg->rank() == 0) {
    const double formula = m.tp > 1 ? megatron_bytes(shape, m, batch) : 0.0;
    JsonRow row{{"mesh", bench.get("mesh")},
                {"params", models::gpt_parameter_count(shape)},
                {"ranks", pg->size()},
                {"peak_rss_bytes", static_cast<int64_t>(t[1].item<double>())},
                {"step_seconds", t[0].item<double>()},
                {"loss", totals.loss},
                {"bytes_sent", static_cast<int64_t>(t[2].item<double>())},
                {"dp_bytes_sent", static_cast<int64_t>(t[3].item<double>())},
                {"bytes_formula", static_cast<int64_t>(formula)},
                {"activation_bytes", static_cast<int64_t>(t[4].item<double>())},
                {"block_activation_bytes", static_cast<int64_t>(t[5].item<double>())},
                {"steps", steps}};
    if (formula > 0) {
      row["bytes_ratio"] = t[2].item<double>() / formula;
    }
    append_row(bench.get("out"), row);
  }
  return 0;
}

std::string mib(double bytes) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(1) << bytes / (1 << 20) << " MiB";
  return s.str();
}

void print_parallel_rows(const Bench& bench, const std::vector<JsonRow>& rows) {
  if (bench.json()) {
    for (const auto& row : rows) {
      print_row(row);
    }
    return;
  }
  std::cout << std::left << std::setw(16) << "mesh" << std::setw(12) << "step (s)" << std::setw(16)
            << "peak RSS/rank" << std::setw(16) << "tp sent/step" << std::setw(16) << "formula"
            << std::setw(8) << "ratio" << std::setw(16) << "activations"
            << "loss\n";
  for (const auto& row : rows) {
    std::cout << std::left << std::setw(16) << string_field(row, "mesh") << std::setw(12)
              << std::fixed << std::setprecision(3) << number_field(row, "step_seconds")
              << std::setw(16) << mib(number_field(row, "peak_rss_bytes")) << std::setw(16)
              << mib(number_field(row, "bytes_sent")) << std::setw(16)
              << mib(number_field(row, "bytes_formula")) << std::setw(8) << std::setprecision(3)
              << (row.contains("bytes_ratio") ? number_field(row, "bytes_ratio") : 0.0)
              << std::setw(16) << mib(number_field(row, "activation_bytes"))
              << number_field(row, "loss") << "\n";
  }
  std::cout.flush();
}

int run_parallel_bench(const Bench& bench) {
  const int ranks = bench.get_int("nproc-per-node", 4);
  std::vector<std::string> meshes;
  std::stringstream in(bench.get("meshes", "tp4+lp tp4+sp+lp tp2+lp,fsdp2 tp2+sp+lp,fsdp2 fsdp4"));
  for (std::string word; in >> word;) {
    const MeshSpec m = parse_mesh(word);  // refused here, before any job starts
    require(m.replicate == 1 || m.shard > 1,
            "mesh '" + word + "': replicateN shards over fsdpN (HSDP); add fsdpN with N above 1");
    require(m.tp * m.shard * m.replicate == ranks,
            "mesh '" + word + "' has " + std::to_string(m.tp * m.shard * m.replicate) +
                " ranks; --nproc-per-node is " + std::to_string(ranks));
    meshes.push_back(word);
  }
  require(!meshes.empty(), "--meshes names no mesh");
  const std::string out = results_file("parallel");
  std::vector<JsonRow> rows;
  for (const auto& mesh : meshes) {
    bench.progress("measuring " + mesh + "...");
    std::remove(out.c_str());
    std::vector<std::string> extra{"--mesh", mesh};
    for (const auto& word :
         bench.forwarded({"layers", "width", "heads", "vocab", "context", "batch-size", "steps"})) {
      extra.push_back(word);
    }
    run_bench_job(bench.worker_command(out, extra), ranks, "gloo", out);
    rows.push_back(read_rows(out).at(0));
  }
  std::remove(out.c_str());
  print_parallel_rows(bench, rows);
  return 0;
}

}  // namespace

int run_bench_parallel(const std::vector<std::string>& argv) {
  return run_benchmark(parallel_spec(), argv, run_parallel_bench, run_parallel_worker);
}

}  // namespace cli
}  // namespace paratrain
