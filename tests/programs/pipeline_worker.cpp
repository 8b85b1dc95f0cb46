// A pipeline test worker: ranks = stages x replicas. Rank r holds stage r % P of pipeline
// replica r / P; the ranks holding the same stage form a data-parallel subgroup (new_group), over
// which the stage is wrapped in DDP when there are several replicas (2-D parallelism).
//
// Every rank also trains, in the same process, the unsplit model on the whole global batch (all
// replicas' batches): each replica's loss is the mean over its samples and DDP averages the
// replicas, so the stage's parameters must follow the reference's within float rounding (1e-5)
// after every step. Before that it checks its subgroups: an allreduce over each gives the sum of
// its members' ranks, and a rank outside a group gets no group.
//
// Options: --stages P --schedule gpipe|1f1b --chunks M --checkpoint --steps N --batch B (per
// replica) --devices D0,D1,... (stage s on Ds; default cpu) --tolerance T (default 1e-5). Prints
// "rank R: ok ..." (exit 0) or "MISMATCH ..." / "error: ..." (exit 1).

#include <paratrain/paratrain.h>

#include <torch/torch.h>

#include <iostream>
#include <map>
#include <sstream>

// In the test programs' one binary (main.cpp): run() is this program's main.
namespace paratrain_test_programs {
namespace pipeline_worker {

namespace pt = paratrain;
namespace nn = torch::nn;

nn::Sequential make_model() {
  torch::manual_seed(0);
  nn::Sequential net;
  net->push_back("fc0", nn::Linear(10, 32));
  net->push_back("relu0", nn::ReLU());
  net->push_back("fc1", nn::Linear(32, 32));
  net->push_back("tanh1", nn::Tanh());
  net->push_back("fc2", nn::Linear(32, 16));
  net->push_back("relu2", nn::ReLU());
  net->push_back("fc3", nn::Linear(16, 4));
  return net;
}

torch::Tensor ce(const torch::Tensor& out, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(out, y);
}

int run(int argc, char** argv) {
  std::map<std::string, std::string> opt;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) == 0) {
      bool has_value = i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0;
      opt[a.substr(2)] = has_value ? argv[++i] : "1";
    }
  }
  auto get = [&](const std::string& k, const std::string& d) { return opt.count(k) ? opt[k] : d; };
  try {
    auto pg = pt::dist::init_process_group();
    const int rank = pg->rank();
    const int world = pg->size();
    const int stages = std::stoi(get("stages", "2"));
    TORCH_CHECK(world % stages == 0, "world size ", world, " is not a multiple of ", stages,
                " stages");
    const int replicas = world / stages;
    const int stage = rank % stages;
    const int replica = rank / stages;
    const int64_t batch = std::stoll(get("batch", "8"));
    const int steps = std::stoi(get("steps", "10"));

    // Subgroups: one per stage (its replicas), made by every rank in the same order.
    pt::dist::ProcessGroupPtr dp_group;
    for (int s = 0; s < stages; ++s) {
      std::vector<int> members;
      for (int d = 0; d < replicas; ++d) {
        members.push_back(d * stages + s);
      }
      auto g = pg->new_group(members);
      TORCH_CHECK((g != nullptr) == (s == stage), "rank ", rank, (g ? " got" : " did not get"),
                  " the group of stage ", s);
      if (g) {
        TORCH_CHECK(g->size() == replicas && g->rank() == replica, "subgroup rank ", g->rank(),
                    " of ", g->size(), ", expected ", replica, " of ", replicas);
        at::Tensor t = torch::tensor({static_cast<double>(rank)});
        g->allreduce(t)->wait();
        double want = 0;
        for (int m : members) {
          want += m;
        }
        TORCH_CHECK(t.item<double>() == want, "subgroup allreduce gave ", t.item<double>(),
                    ", expected ", want);
        dp_group = g;
      }
    }

    std::vector<int> stage_ranks;
    for (int s = 0; s < stages; ++s) {
      stage_ranks.push_back(replica * stages + s);
    }
    auto model = make_model();
    auto reference = make_model();
    std::vector<int64_t> balance =
        stages == 2 ? std::vector<int64_t>{3, 4} : std::vector<int64_t>{2, 3, 2};
    TORCH_CHECK(stages == 2 || stages == 3, "this worker knows 2 or 3 stages");
    auto mine = pt::pipeline::split(model, balance)[static_cast<size_t>(stage)];
    std::vector<torch::Device> devices;
    {
      std::stringstream list(get("devices", "cpu"));
      for (std::string d; std::getline(list, d, ',');) {
        devices.emplace_back(d);
      }
    }
    const torch::Device device = devices.at(static_cast<size_t>(stage) % devices.size());
    const double tolerance = std::stod(get("tolerance", "1e-5"));
    auto options = pt::pipeline::PipelineOptions()
                       .chunks(std::stoll(get("chunks", "4")))
                       .schedule(pt::pipeline::parse_schedule(get("schedule", "gpipe")))
                       .checkpoint(opt.count("checkpoint") > 0);
    pt::pipeline::DistributedPipeline pipe(mine, stage, pg, stage_ranks, device, ce, options,
                                           replicas > 1 ? dp_group : nullptr);
    torch::optim::SGD o1(mine->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    torch::optim::SGD o2(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    torch::manual_seed(1);
    double worst = 0;
    for (int step = 0; step < steps; ++step) {
      auto x = torch::randn({batch * replicas, 10});  // the same global batch on every rank
      auto y = torch::randint(0, 4, {batch * replicas});
      o2.zero_grad();
      auto want = ce(reference->forward(x), y);
      want.backward();
      o2.step();
      o1.zero_grad();
      auto xs = x.slice(0, replica * batch, (replica + 1) * batch);
      auto ys = y.slice(0, replica * batch, (replica + 1) * batch);
      auto loss = pipe.step(pipe.is_first() ? xs : at::Tensor(),
                            pipe.is_last() ? ys.to(device) : at::Tensor());
      o1.step();
      if (pipe.is_last() && replicas == 1) {
        worst = std::max(worst, std::abs(loss.item<double>() - want.item<double>()));
      }
      auto ref = reference->named_parameters();
      for (const auto& p : mine->named_parameters()) {
        const double d = (p.value().cpu() - ref[p.key()]).abs().max().item<double>();
        worst = std::max(worst, d);
        if (d > tolerance) {
          std::cout << "MISMATCH rank " << rank << " step " << step << " " << p.key() << " by " << d
                    << std::endl;
          return 1;
        }
      }
    }
    std::cout << "rank " << rank << ": ok (stage " << stage << " of replica " << replica
              << ", worst difference " << worst << ", live micro-batches "
              << pipe.last_stats().max_live_micro_batches << ")" << std::endl;
    pg->barrier()->wait();
    return 0;
  } catch (const std::exception& e) {
    const auto* c10e = dynamic_cast<const c10::Error*>(&e);
    std::cout << "error: " << (c10e ? c10e->what_without_backtrace() : e.what()) << std::endl;
    return 1;
  }
}

}  // namespace pipeline_worker
}  // namespace paratrain_test_programs
