// A SyncBatchNorm test worker. Every rank holds a SyncBatchNorm (converted from a BatchNorm) and,
// in the same process, a reference BatchNorm that sees the whole batch: every rank's rows
// together. Rank r holds `--rows` rows plus r * `--skew` (so batches are uneven, down to zero
// rows with a negative skew).
//
// --mode module (default): over --steps training iterations, each rank's output must equal its
//   rows of the reference's output; with loss = sum(out * G) for a fixed G, its input gradient
//   must equal its rows of the reference's, and the sum over ranks of its weight and bias
//   gradients the reference's; the running statistics must equal the reference's. Then in eval
//   mode the outputs must agree again. Tolerance 1e-5 (float rounding of different summation
//   orders).
// --mode ddp: a small network with BatchNorm1d, converted with convert_sync_batchnorm and
//   wrapped in DDP, trains --steps SGD steps on equal per-rank batches; the reference trains the
//   same network on the whole batch in one process. Parameters and running statistics must agree
//   within 1e-5.
// --dim 1|2: BatchNorm1d on [N, C] or BatchNorm2d on [N, C, H, W].
// Prints "rank R: ok" (exit 0) or "MISMATCH ..." / "error: ..." (exit 1).

#include <paratrain/paratrain.h>

#include <torch/torch.h>

#include <iostream>
#include <map>

// In the test programs' one binary (main.cpp): run() is this program's main.
namespace paratrain_test_programs {
namespace syncbn_worker {

namespace pt = paratrain;

namespace {

std::map<std::string, std::string> parse(int argc, char** argv) {
  std::map<std::string, std::string> opt;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
      opt[a] = argv[++i];
    } else {
      opt[a] = "1";
    }
  }
  return opt;
}

struct Mismatch : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void expect_close(const torch::Tensor& a, const torch::Tensor& b, const std::string& what) {
  if (a.sizes() != b.sizes()) {
    throw Mismatch(what + ": shapes differ");
  }
  if (a.numel() == 0) {
    return;
  }
  double d = (a - b).abs().max().item<double>();
  if (!(d <= 1e-5)) {
    throw Mismatch(what + " differs by " + std::to_string(d));
  }
}

torch::Tensor gather_sum(pt::dist::ProcessGroup& pg, torch::Tensor t) {
  t = t.clone().contiguous();
  pg.allreduce(t, pt::dist::ReduceOp::kSum)->wait();
  return t;
}

void run_module(pt::dist::ProcessGroupPtr pg, int dim, int rows, int skew, int steps) {
  const int W = pg->size();
  const int me = pg->rank();
  const int64_t C = 6;
  std::vector<int64_t> counts;
  for (int r = 0; r < W; ++r) {
    counts.push_back(std::max(0, rows + r * skew));
  }
  int64_t total = 0, first = 0;
  for (int r = 0; r < W; ++r) {
    first += r < me ? counts[r] : 0;
    total += counts[r];
  }
  auto shape = [&](int64_t n) {
    return dim == 1 ? std::vector<int64_t>{n, C} : std::vector<int64_t>{n, C, 3, 2};
  };
  torch::nn::Sequential holder;
  std::shared_ptr<torch::nn::Module> reference;
  std::function<torch::Tensor(const torch::Tensor&)> ref_forward;
  torch::manual_seed(7);
  if (dim == 1) {
    auto a = torch::nn::BatchNorm1d(C);
    auto b = torch::nn::BatchNorm1d(C);
    holder->push_back("bn", a);
    reference = b.ptr();
    ref_forward = [b](const torch::Tensor& x) mutable { return b(x); };
  } else {
    auto a = torch::nn::BatchNorm2d(C);
    auto b = torch::nn::BatchNorm2d(C);
    holder->push_back("bn", a);
    reference = b.ptr();
    ref_forward = [b](const torch::Tensor& x) mutable { return b(x); };
  }
  {
    torch::NoGradGuard g;
    auto w = torch::rand({C}) + 0.5;
    auto bias = torch::randn({C});
    for (auto* m : {holder[0].get(), reference.get()}) {
      m->named_parameters()["weight"].copy_(w);
      m->named_parameters()["bias"].copy_(bias);
    }
  }
  if (pt::convert_sync_batchnorm(holder.ptr(), pg) != 1) {
    throw Mismatch("convert_sync_batchnorm did not convert the one BatchNorm");
  }
  auto sync = holder->ptr<pt::SyncBatchNormImpl>(0);
  for (int s = 0; s < steps; ++s) {
    torch::manual_seed(100 + s);  // the same whole batch on every rank
    torch::Tensor X = torch::randn(shape(total)) * 3 + 1;
    torch::Tensor G = torch::randn(shape(total));
    torch::Tensor mine = X.narrow(0, first, counts[me]).clone().requires_grad_(true);
    torch::Tensor out = holder->forward(mine);
    (out * G.narrow(0, first, counts[me])).sum().backward();
    torch::Tensor all = X.clone().requires_grad_(true);
    torch::Tensor ref_out = ref_forward(all);
    (ref_out * G).sum().backward();
    const std::string at = " at step " + std::to_string(s);
    expect_close(out, ref_out.narrow(0, first, counts[me]), "output" + at);
    expect_close(mine.grad(), all.grad().narrow(0, first, counts[me]), "input gradient" + at);
    expect_close(gather_sum(*pg, sync->weight.grad()),
                 reference->named_parameters()["weight"].grad(), "summed weight gradient" + at);
    expect_close(gather_sum(*pg, sync->bias.grad()), reference->named_parameters()["bias"].grad(),
                 "summed bias gradient" + at);
    sync->weight.mutable_grad().zero_();
    sync->bias.mutable_grad().zero_();
    reference->zero_grad();
  }
  auto ref_buffers = reference->named_buffers();
  expect_close(sync->running_mean, ref_buffers["running_mean"], "running_mean");
  expect_close(sync->running_var, ref_buffers["running_var"], "running_var");
  if (!torch::equal(sync->num_batches_tracked, ref_buffers["num_batches_tracked"])) {
    throw Mismatch("num_batches_tracked differs");
  }
  holder->eval();
  reference->eval();
  torch::Tensor X = torch::randn(shape(total));
  expect_close(holder->forward(X.narrow(0, first, counts[me])),
               ref_forward(X).narrow(0, first, counts[me]), "eval-mode output");
}

torch::nn::Sequential small_net() {
  return torch::nn::Sequential({{"fc0", torch::nn::Linear(12, 16)},
                                {"bn0", torch::nn::BatchNorm1d(16)},
                                {"relu0", torch::nn::ReLU()},
                                {"fc1", torch::nn::Linear(16, 4)}});
}

void run_ddp(pt::dist::ProcessGroupPtr pg, int rows, int steps) {
  const int W = pg->size();
  const int me = pg->rank();
  torch::manual_seed(3);
  auto model = small_net();
  auto reference = small_net();
  {
    torch::NoGradGuard g;
    auto src = model->parameters();
    auto dst = reference->parameters();
    for (size_t i = 0; i < src.size(); ++i) {
      dst[i].copy_(src[i]);
    }
  }
  pt::convert_sync_batchnorm(model.ptr(), pg);
  pt::DistributedDataParallel ddp(model, pg);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int s = 0; s < steps; ++s) {
    torch::manual_seed(500 + s);
    torch::Tensor X = torch::randn({W * rows, 12});
    torch::Tensor Y = torch::randint(0, 4, {W * rows});
    opt.zero_grad();
    ref_opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(ddp.forward(X.narrow(0, me * rows, rows)),
                                                     Y.narrow(0, me * rows, rows));
    loss.backward();
    opt.step();
    torch::nn::functional::cross_entropy(reference->forward(X), Y).backward();
    ref_opt.step();
  }
  auto ref_params = reference->named_parameters();
  for (const auto& p : model->named_parameters()) {
    expect_close(p.value(), ref_params[p.key()], p.key());
  }
  auto ref_buffers = reference->named_buffers();
  for (const auto& b : model->named_buffers()) {
    expect_close(b.value().to(torch::kDouble), ref_buffers[b.key()].to(torch::kDouble), b.key());
  }
}

}  // namespace

int run(int argc, char** argv) {
  auto opt = parse(argc, argv);
  auto get = [&](const std::string& k, const std::string& d) { return opt.count(k) ? opt[k] : d; };
  int rank = -1;
  try {
    torch::set_num_threads(1);
    auto pg = pt::dist::init_process_group();
    rank = pg->rank();
    const int steps = std::stoi(get("--steps", "3"));
    const int rows = std::stoi(get("--rows", "4"));
    if (get("--mode", "module") == "ddp") {
      run_ddp(pg, rows, steps);
    } else {
      run_module(pg, std::stoi(get("--dim", "1")), rows, std::stoi(get("--skew", "0")), steps);
    }
    std::cout << "rank " << rank << ": ok" << std::endl;
    return 0;
  } catch (const Mismatch& e) {
    std::cout << "MISMATCH on rank " << rank << ": " << e.what() << std::endl;
  } catch (const std::exception& e) {
    std::cout << "error: " << e.what() << std::endl;
  }
  return 1;
}

}  // namespace syncbn_worker
}  // namespace paratrain_test_programs
