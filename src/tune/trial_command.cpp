// The command line and environment of a command or train trial, from the tuner's options and the
// trial's config.

#include "trial_command.h"

#include "pbt.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <sstream>

namespace paratrain {
namespace tune {
namespace detail {
namespace {

// A train trial: `paratrain train` with the fixed flags, checkpoints in `dir` every epoch,
// --epochs from the scheduler's max_t (unless given), and the sampled values as flags.
std::vector<std::string> train_argv(const TunerOptions& o,
                                    const std::string& program,
                                    const Config& config,
                                    const std::string& dir) {
  std::vector<std::string> argv = {program, "train"};
  argv.insert(argv.end(), o.train_args().begin(), o.train_args().end());
  argv.insert(argv.end(), {"--json", "--checkpoint-dir", dir + "/checkpoints",
                           "--checkpoint-every-epoch", "--resume", "auto"});
  const int64_t max_t = effective_max_t(o.scheduler());
  const auto& ta = o.train_args();
  const bool has_epochs = std::any_of(ta.begin(), ta.end(), [](const std::string& w) {
    return w == "--epochs" || w.rfind("--epochs=", 0) == 0;
  });
  if (max_t > 0 && !has_epochs) {
    argv.insert(argv.end(), {"--epochs", std::to_string(max_t)});
  }
  if (o.scheduler().kind() == "pbt") {  // it may resume another trial's checkpoint, perturbed
    std::string names;
    for (const std::string& name : mutation_names(o.scheduler())) {
      names += (names.empty() ? "" : ",") + name;
    }
    argv.insert(argv.end(), {"--resume-may-change", names});
  }
  for (const auto& [name, v] : config) {
    argv.push_back("--" + name);
    argv.push_back(to_string(v));
  }
  return argv;
}

// A command trial: its words, each {name} replaced by the sampled value.
std::vector<std::string> command_argv(const TunerOptions& o, const Config& config) {
  std::vector<std::string> argv;
  for (std::string word : o.command()) {
    for (const auto& [name, v] : config) {
      const std::string key = "{" + name + "}";
      for (size_t at = word.find(key); at != std::string::npos;
           at = word.find(key, at + to_string(v).size())) {
        word.replace(at, key.size(), to_string(v));
      }
    }
    argv.push_back(word);
  }
  return argv;
}

}  // namespace

ProcessSpec trial_process_spec(const TunerOptions& o,
                               const std::string& program,
                               const TrialRecord& t,
                               const std::vector<int>& cores,
                               const std::vector<int>& gpus,
                               bool gpus_visible,
                               bool resume) {
  const std::string dir = t.log_path.substr(0, t.log_path.rfind('/'));
  ProcessSpec spec;
  spec.program = program;
  spec.log_path = t.log_path;
  for (int c : cores) {
    if (c >= 0) {
      spec.cores.push_back(c);
    }
  }
  spec.argv = o.train() ? train_argv(o, program, t.config, dir) : command_argv(o, t.config);
  for (const auto& [name, v] : t.config) {
    spec.env[name] = to_string(v);
  }
  spec.env["PARATRAIN_TRIAL_NUMBER"] = std::to_string(t.number);
  spec.env["PARATRAIN_TRIAL_DIR"] = dir;
  spec.env["PARATRAIN_CHECKPOINT_DIR"] = dir + "/checkpoints";
  spec.env["PARATRAIN_TRIAL_RESUME"] = resume ? "1" : "0";
  if (o.train()) {
    // One FIFO per start of the trial, named for this host, process and start: another tuner's
    // process of it (a trial taken over, perhaps from a container with the same pid) must never
    // meet this one's. start_process makes it without replacing anything of that name, and sets
    // PARATRAIN_TRIAL_SYNC to it.
    static uint64_t starts = 0;
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    spec.sync_path = dir + "/.epoch-sync." + host + "." + std::to_string(::getpid()) + "." +
                     std::to_string(++starts);
  }
  spec.env["OMP_NUM_THREADS"] = std::to_string(o.resources().threads());
  if (gpus_visible) {
    // The tuner's GPU i is the i-th of its own CUDA_VISIBLE_DEVICES, when it has one (Slurm).
    std::vector<std::string> visible;
    if (const char* cvd = std::getenv("CUDA_VISIBLE_DEVICES")) {
      std::stringstream list(cvd);
      for (std::string g; std::getline(list, g, ',');) {
        visible.push_back(g);
      }
    }
    std::string value;
    for (int g : gpus) {
      value += (value.empty() ? "" : ",") +
               (g < static_cast<int>(visible.size()) ? visible[g] : std::to_string(g));
    }
    spec.env["CUDA_VISIBLE_DEVICES"] = value;
  }
  return spec;
}

}  // namespace detail
}  // namespace tune
}  // namespace paratrain
