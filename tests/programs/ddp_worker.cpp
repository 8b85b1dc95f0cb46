// A DDP test worker. Every rank trains the same model with DistributedDataParallel on its
// DistributedSampler shard and, in the same process, a reference copy with plain single-process
// training on the whole batch (all ranks' shards together). After the steps it compares the two.
//
// Why equal: each rank's loss is the mean over its B samples, and DDP averages the ranks'
// gradients, which is the gradient of the mean over all W*B samples, the reference's loss. Only
// float rounding differs (summation order), hence the 1e-5 tolerance; compression hooks round
// gradients to 16 bits, hence their looser one.
//
// Options: --steps N --step-sleep-ms MS --batch B --bucket-cap-mb X --first-bucket-mb X --view
//          --zero-in-place (gradients zeroed in place, not by zero_grad()) --unused
//          --micro-steps K (K-1 of them under no_sync) --hook fp16|bf16|allreduce --bn
//          --no-broadcast-buffers
//          --expect-unused-error --mismatch
//          --sometimes (with --unused: the spare layer is used in even micro-batches only, so
//          under no_sync it has a gradient that the final synced backward never touches)
// Prints "rank R: ok ..." (exit 0) or "MISMATCH ..." / "error: ..." (exit 1).

#include <paratrain/paratrain.h>

#include <torch/torch.h>

#include <chrono>
#include <iostream>
#include <map>
#include <thread>

// In the test programs' one binary (main.cpp): run() is this program's main.
namespace paratrain_test_programs {
namespace ddp_worker {

namespace pt = paratrain;

struct NetImpl : torch::nn::Module {
  NetImpl(int in, bool unused, bool bn) : with_bn(bn) {
    fc1 = register_module("fc1", torch::nn::Linear(in, 64));
    if (bn) {
      norm = register_module("norm", torch::nn::BatchNorm1d(64));
    }
    if (unused) {
      spare = register_module("spare", torch::nn::Linear(64, 64));  // never used in forward
    }
    fc2 = register_module("fc2", torch::nn::Linear(64, 48));
    fc3 = register_module("fc3", torch::nn::Linear(48, 5));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = fc1(x);
    if (with_bn) {
      x = norm(x);
    }
    x = torch::relu(x);
    if (use_spare) {
      x = x + 0.1 * spare(x);
    }
    x = torch::relu(fc2(x));
    return fc3(x);
  }
  bool with_bn;
  bool use_spare = false;  // --sometimes: the spare layer joins some micro-batches' forward
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr}, spare{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
};
TORCH_MODULE(Net);

int run(int argc, char** argv) {
  std::map<std::string, std::string> opt;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
      opt[a] = argv[++i];
    } else {
      opt[a] = "1";
    }
  }
  auto get = [&](const std::string& k, const std::string& d) { return opt.count(k) ? opt[k] : d; };
  try {
    torch::set_num_threads(1);
    auto pg = pt::dist::init_process_group();
    const int W = pg->size();
    const int me = pg->rank();
    const int steps = std::stoi(get("--steps", "10"));
    const int B = std::stoi(get("--batch", "8"));
    const int K = std::stoi(get("--micro-steps", "1"));
    // A job that must run for a while (the elastic tests) sleeps between steps rather than taking
    // thousands: after ~2700 steps of this training the reference's and DDP's rounding can part
    // ways for good (seen with libtorch 2.15 on 3 ranks: 9e-7 at 2600 steps, 0.2 at 2800).
    const int sleep_ms = std::stoi(get("--step-sleep-ms", "0"));
    const bool unused = opt.count("--unused") || opt.count("--expect-unused-error");
    const bool bn = opt.count("--bn") > 0;
    const int in = (opt.count("--mismatch") && me == 1) ? 21 : 20;

    pt::DDPOptions o;
    o.bucket_cap_mb(std::stod(get("--bucket-cap-mb", "25")))
        .first_bucket_mb(std::stod(get("--first-bucket-mb", "1")))
        .gradient_as_bucket_view(opt.count("--view") > 0)
        .find_unused_parameters(opt.count("--unused") > 0)
        .broadcast_buffers(!opt.count("--no-broadcast-buffers"));

    // Rank-specific seed: DDP must replace these weights with rank 0's.
    torch::manual_seed(100 + me);
    Net model(in, unused, bn);
    pt::DistributedDataParallel ddp(model, pg, o);
    if (get("--hook", "") == "fp16") {
      ddp.register_comm_hook(pt::fp16_compress_hook());
    } else if (get("--hook", "") == "bf16") {
      ddp.register_comm_hook(pt::bf16_compress_hook());
    } else if (get("--hook", "") == "allreduce") {
      ddp.register_comm_hook(std::make_shared<pt::AllreduceHook>());
    }
    // The reference starts from rank 0's weights, which DDP has just broadcast.
    Net reference(in, unused, bn);
    {
      torch::NoGradGuard g;
      auto src = model->parameters();
      auto dst = reference->parameters();
      for (size_t i = 0; i < src.size(); ++i) {
        dst[i].copy_(src[i]);
      }
    }
    torch::optim::SGD opt_ddp(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD opt_ref(reference->parameters(),
                              torch::optim::SGDOptions(0.05).momentum(0.9));

    const int64_t N = static_cast<int64_t>(W) * B * steps * K;
    torch::manual_seed(1234);  // the same data on every rank
    torch::Tensor X = torch::randn({N, 20});
    torch::Tensor Y = torch::randint(0, 5, {N});
    std::vector<pt::data::DistributedSampler> samplers;
    for (int r = 0; r < W; ++r) {
      samplers.emplace_back(static_cast<size_t>(N), W, r, /*shuffle=*/true, /*seed=*/0);
    }
    auto rows = [&](int r, int micro) {
      const auto& idx = samplers[r].indices();
      std::vector<int64_t> pick(idx.begin() + micro * B, idx.begin() + (micro + 1) * B);
      return torch::tensor(pick, torch::kLong);
    };

    for (int s = 0; s < steps; ++s) {
      std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
      if (opt.count("--zero-in-place")) {
        // In place, so that the gradients stay the buckets' memory under --view (libtorch 2.x's
        // zero_grad() sets them to none): DDP then divides them where they are, not while copying.
        for (auto& p : model->parameters()) {
          if (p.grad().defined()) {
            p.mutable_grad().zero_();
          }
        }
      } else {
        opt_ddp.zero_grad();
      }
      opt_ref.zero_grad();
      for (int m = 0; m < K; ++m) {
        const int micro = s * K + m;
        torch::Tensor mine = rows(me, micro);
        model->use_spare = reference->use_spare = opt.count("--sometimes") && m % 2 == 0;
        auto step_ddp = [&] {
          auto loss = torch::nn::functional::cross_entropy(ddp.forward(X.index_select(0, mine)),
                                                           Y.index_select(0, mine));
          loss.backward();
        };
        if (m + 1 < K) {
          auto guard = ddp.no_sync();
          step_ddp();
        } else {
          step_ddp();
        }
        std::vector<torch::Tensor> all;
        for (int r = 0; r < W; ++r) {
          all.push_back(rows(r, micro));
        }
        torch::Tensor full = torch::cat(all);
        auto loss_ref = torch::nn::functional::cross_entropy(
            reference->forward(X.index_select(0, full)), Y.index_select(0, full));
        loss_ref.backward();
      }
      opt_ddp.step();
      opt_ref.step();
    }

    if (bn) {
      // Parameters must agree across ranks; buffers agree with rank 0's after a forward when
      // broadcast_buffers is on, and differ without it.
      model->eval();
      ddp.forward(X.index_select(0, rows(me, 0)));
      at::Tensor mean = model->norm->running_mean.clone();
      std::vector<at::Tensor> gathered;
      for (int r = 0; r < W; ++r) {
        gathered.push_back(torch::zeros_like(mean));
      }
      pg->allgather(gathered, mean)->wait();
      bool same = true;
      for (int r = 1; r < W; ++r) {
        same = same && torch::equal(gathered[r], gathered[0]);
      }
      bool want_same = !opt.count("--no-broadcast-buffers");
      if (same != want_same) {
        std::cout << "MISMATCH running_mean " << (same ? "equal" : "different")
                  << " across ranks with broadcast_buffers=" << want_same << std::endl;
        return 1;
      }
      at::Tensor flat = torch::cat({model->fc1->weight.flatten(), model->fc3->weight.flatten()});
      std::vector<at::Tensor> fl;
      for (int r = 0; r < W; ++r) {
        fl.push_back(torch::zeros_like(flat));
      }
      pg->allgather(fl, flat)->wait();
      for (int r = 1; r < W; ++r) {
        if (!torch::allclose(fl[r], fl[0], 0, 1e-6)) {
          std::cout << "MISMATCH parameters differ across ranks" << std::endl;
          return 1;
        }
      }
      std::cout << "rank " << me << ": ok (BatchNorm, buffers " << (same ? "equal" : "per rank")
                << ")" << std::endl;
      return 0;
    }

    const double tol = opt.count("--hook") && get("--hook", "") != "allreduce"
                           ? std::stod(get("--tol", "3e-3"))
                           : 1e-5;
    double worst = 0;
    std::string worst_name;
    auto named_ddp = model->named_parameters();
    auto named_ref = reference->named_parameters();
    for (const auto& item : named_ddp) {
      double d = (item.value() - named_ref[item.key()]).abs().max().item<double>();
      if (d > worst) {
        worst = d;
        worst_name = item.key();
      }
    }
    if (unused && !opt.count("--sometimes")) {
      // Unused everywhere: no gradient, so SGD never moved it (as in single-process training).
      if (!torch::equal(model->spare->weight, reference->spare->weight)) {
        std::cout << "MISMATCH the unused parameter moved" << std::endl;
        return 1;
      }
    }
    if (!(worst <= tol)) {
      std::cout << "MISMATCH rank " << me << ": max |ddp - reference| = " << worst << " at "
                << worst_name << " (tolerance " << tol << ")" << std::endl;
      return 1;
    }
    std::cout << "rank " << me << ": ok, max diff " << worst << " after " << steps << " steps, "
              << ddp.bucket_assignment().size() << " buckets" << std::endl;
    return 0;
  } catch (const c10::Error& e) {
    std::cout << "error: " << e.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cout << "error: " << e.what() << std::endl;
    return 1;
  }
}

}  // namespace ddp_worker
}  // namespace paratrain_test_programs
