// An elastic training worker: the Trainer under DDP on a dataset whose sample i carries i in its
// first pixel, resuming (--resume auto) from checkpoints that may come from another world size.
// After each optimizer step every rank appends "epoch step i i i ..." (the samples of the batch it
// trained) to DIR/rank-R.attempt-A, written unbuffered so that a SIGKILL loses at most the step
// under way. The test reads these logs to check that across a membership change no sample of the
// epoch is lost or trained twice.
// Arguments: DIR CHECKPOINT_DIR [SAMPLES] [STEP_SLEEP_MS]
// Prints "rank R: ok world W" (exit 0) or "error: ..." (exit 1).

#include <paratrain/paratrain.h>

#include <torch/torch.h>

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <deque>
#include <iostream>
#include <mutex>
#include <thread>

// In the test programs' one binary (main.cpp): run() is this program's main.
namespace paratrain_test_programs {
namespace elastic_worker {

namespace pt = paratrain;

int run(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: elastic_worker DIR CHECKPOINT_DIR [SAMPLES] [STEP_SLEEP_MS]" << std::endl;
    return 2;
  }
  const std::string dir = argv[1];
  const int64_t n = argc > 3 ? std::stoll(argv[3]) : 960;
  const int sleep_ms = argc > 4 ? std::stoi(argv[4]) : 100;
  try {
    torch::set_num_threads(1);
    auto pg = pt::dist::init_process_group();
    const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
    const std::string log =
        dir + "/rank-" + std::to_string(pg->rank()) + ".attempt-" + (attempt ? attempt : "0");
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) {
      throw std::runtime_error("cannot write " + log);
    }
    torch::manual_seed(0);
    torch::Tensor images = torch::rand({n, 1, 28, 28});
    images.index_put_({torch::indexing::Slice(), 0, 0, 0}, torch::arange(n).to(torch::kFloat));
    auto train = std::make_shared<pt::data::TensorDataset>(images, torch::randint(0, 10, {n}));

    std::mutex mutex;
    std::deque<std::vector<int64_t>> seen;  // transformed batches, in order, not yet stepped
    const char* elastic = std::getenv("PARATRAIN_ELASTIC");
    pt::TrainerOptions o;
    o.strategy(pt::Strategy::kDDP)
        .process_group(pg)
        .epochs(1)
        .batch_size(8)
        .workers(1)
        .checkpoint_dir(argv[2])
        .checkpoint_every(4)
        .keep(3)
        .resume("auto")
        .elastic(elastic != nullptr && std::string(elastic) == "1")
        .input_transform([&](const torch::Tensor& x) {
          torch::Tensor ids = x.index({torch::indexing::Slice(), 0, 0, 0}).round().to(torch::kLong);
          std::lock_guard<std::mutex> lock(mutex);
          seen.emplace_back(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
          return x;
        });
    pt::Trainer trainer(pt::models::make("mlp"), train, nullptr, o);
    trainer.on_step_end([&](const pt::StepInfo& info) {
      std::vector<int64_t> ids;
      {
        std::lock_guard<std::mutex> lock(mutex);
        ids = seen.front();
        seen.pop_front();
      }
      std::string line = std::to_string(info.epoch) + " " + std::to_string(info.global_step);
      for (int64_t i : ids) {
        line += " " + std::to_string(i);
      }
      line += "\n";
      if (::write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size())) {
        throw std::runtime_error("cannot append to " + log);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
    });
    trainer.fit();
    ::close(fd);
    std::cout << "rank " << pg->rank() << ": ok world " << pg->size() << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cout << "error: " << e.what() << std::endl;
  }
  return 1;
}

}  // namespace elastic_worker
}  // namespace paratrain_test_programs
