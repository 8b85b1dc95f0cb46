// Population-based training (scheduler.h's "pbt"): Ray Tune's PopulationBasedTraining in its
// asynchronous form, with its defaults and its explore rules; the code is ours. The scheduler
// decides; the tuner copies the checkpoint, stores the new config and the exploit, and restarts
// the trial (tuner.cpp).

#include "pbt.h"

#include "limits.h"
#include "util/files.h"

#include <c10/util/Exception.h>

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <map>
#include <set>

namespace paratrain {
namespace tune {
namespace {

class Pbt : public Scheduler {
 public:
  explicit Pbt(const SchedulerOptions& o)
      : max_t_(o.max_t()),
        interval_(o.perturbation_interval()),
        quantile_(o.quantile_fraction()),
        resample_(o.resample_probability()),
        population_(o.population()),
        slots_(o.slots()),
        rng_(o.seed() * 0x9e3779b97f4a7c15ULL + 0x5eed) {
    for (const std::string& m : o.mutations()) {
      const size_t eq = m.find('=');
      TORCH_CHECK(eq != std::string::npos && eq > 0, "tune: --mutation '", m,
                  "' is not NAME=DISTRIBUTION (as 'lr=loguniform(1e-4, 1e-1)')");
      mutations_.emplace(m.substr(0, eq), Domain::parse(m.substr(eq + 1)));
    }
  }

  void on_trial_add(int64_t number) override { trials_[number]; }
  void on_config(int64_t number, const Config& config) override { trials_[number].config = config; }

  Decision on_result(int64_t number, int64_t iteration, double loss) override {
    last_rung_ = 0;
    State& s = record(number, iteration, loss);
    if (max_t_ > 0 && iteration >= max_t_) {
      last_rung_ = iteration;
      s.ended = true;  // done: no trial copies it from here on
      return Decision::kComplete;
    }
    if (iteration - s.last_perturbation < interval_) {
      return Decision::kContinue;
    }
    s.last_perturbation = iteration;
    const auto [lower, upper] = quantiles();
    if (std::find(lower.begin(), lower.end(), number) != lower.end() && !upper.empty()) {
      exploit(number, upper);
      return pause(number);
    }
    // Ray's time sharing: a trial at a perturbation point yields to trials waiting for a slot,
    // when there are more trials to run than slots.
    const bool others_wait =
        static_cast<int64_t>(trials_.size()) < population_ ||
        std::any_of(waiting_.begin(), waiting_.end(), [&](int64_t n) { return n != number; });
    return others_wait && contended() ? pause(number) : Decision::kContinue;
  }

  // Another tuner's trial, or a stored result: where it stands, without deciding anything.
  void observe(int64_t number, int64_t iteration, double loss) override {
    State& s = record(number, iteration, loss);
    last_rung_ = max_t_ > 0 && iteration >= max_t_ ? iteration : 0;
    if (iteration - s.last_perturbation >= interval_) {
      s.last_perturbation = iteration;  // its owner perturbed it there
    }
    s.ended = s.ended || (max_t_ > 0 && iteration >= max_t_);
  }
  void on_paused(int64_t number) override {
    if (!trials_[number].ended) {
      pause(number);
    }
  }
  void on_start(int64_t number) override { waiting_.erase(number); }

  void on_trial_end(int64_t number, double) override {
    trials_[number].ended = true;
    waiting_.erase(number);
    paused_.erase(number);
  }

  // Paused trials resume once every trial of the population started (the tuner starts new ones
  // while none is promoted), the one furthest behind first.
  std::vector<int64_t> take_promoted() override {
    if (static_cast<int64_t>(trials_.size()) < population_ || paused_.empty()) {
      return {};
    }
    std::vector<int64_t> out(paused_.begin(), paused_.end());
    std::stable_sort(out.begin(), out.end(),
                     [&](int64_t a, int64_t b) { return trials_[a].time < trials_[b].time; });
    paused_.clear();  // they stay in waiting_ until they start
    return out;
  }

  std::optional<Exploit> take_exploit(int64_t number) override {
    const auto it = exploits_.find(number);
    if (it == exploits_.end()) {
      return std::nullopt;
    }
    Exploit e = std::move(it->second);
    exploits_.erase(it);
    return e;
  }

  int64_t last_rung() const override { return last_rung_; }

 private:
  struct State {
    Config config;
    int64_t time = 0;
    double score = std::nan("");
    int64_t last_perturbation = 0;
    bool ended = false;
    bool exploiting = false;  // an exploit decided, its copy not in place or not trained on yet
  };

  // Whether the unfinished trials (started or not) outnumber the slots.
  bool contended() const {
    int64_t active = std::max<int64_t>(0, population_ - static_cast<int64_t>(trials_.size()));
    for (const auto& [n, s] : trials_) {
      active += s.ended ? 0 : 1;
    }
    return slots_ > 0 && active > slots_;
  }

  State& record(int64_t number, int64_t iteration, double loss) {
    State& s = trials_[number];
    waiting_.erase(number);
    paused_.erase(number);
    s.exploiting = false;
    s.time = iteration;
    s.score = -loss;  // higher is better, as Ray's metric * mode sign; a NaN loss is +inf
    return s;
  }

  Decision pause(int64_t number) {
    paused_.insert(number);
    waiting_.insert(number);
    return Decision::kPause;
  }

  // Ray's _quantiles: the unfinished trials with a last result, sorted (a diverged one, -inf,
  // lowest); each quantile has ceil(n * quantile_fraction) of them, at most half; none with
  // fewer than two trials.
  std::pair<std::vector<int64_t>, std::vector<int64_t>> quantiles() const {
    std::vector<std::pair<double, int64_t>> ranked;
    for (const auto& [n, s] : trials_) {
      if (!s.ended && !std::isnan(s.score)) {
        ranked.emplace_back(s.score, n);
      }
    }
    if (ranked.size() <= 1) {
      return {};
    }
    std::sort(ranked.begin(), ranked.end());
    const double n = static_cast<double>(ranked.size());
    size_t k = static_cast<size_t>(std::ceil(n * quantile_));
    if (static_cast<double>(k) > n / 2) {
      k = static_cast<size_t>(std::floor(n / 2));
    }
    std::vector<int64_t> lower, upper;
    for (size_t i = 0; i < k; ++i) {
      lower.push_back(ranked[i].second);
      const int64_t top = ranked[ranked.size() - 1 - i].second;
      if (!trials_.at(top).exploiting) {  // its checkpoint is about to be replaced
        upper.push_back(top);
      }
    }
    return {lower, upper};
  }

  // The trial takes a random top trial's checkpoint and perturbed config; as in Ray, it also
  // takes that trial's time and last perturbation time.
  void exploit(int64_t number, const std::vector<int64_t>& upper) {
    std::uniform_int_distribution<size_t> pick(0, upper.size() - 1);
    const int64_t source = upper[pick(rng_)];
    const State& from = trials_.at(source);
    State& s = trials_.at(number);
    s.config = explore(from.config);
    s.time = from.time;
    s.last_perturbation = from.last_perturbation;
    s.exploiting = true;
    exploits_[number] = Exploit{source, from.time, s.config};
  }

  // Ray's _explore: a choice is resampled (with resample_probability, or when the value is not
  // one of its values) or moved one place either way, clamped to its ends; any other
  // distribution is resampled, or its value multiplied by 1.2 or 0.8 (an integer truncated).
  Config explore(Config config) {
    std::uniform_real_distribution<double> u(0, 1);
    for (const auto& [name, domain] : mutations_) {
      Value& v = config[name];
      const bool resample = u(rng_) < resample_;
      if (domain.categorical()) {
        const auto& values = domain.values();
        const auto at = std::find(values.begin(), values.end(), v);
        if (resample || at == values.end()) {
          v = values[std::uniform_int_distribution<size_t>(0, values.size() - 1)(rng_)];
        } else {
          const int64_t i = (at - values.begin()) + (u(rng_) < 0.5 ? -1 : 1);
          v = values[static_cast<size_t>(
              std::clamp<int64_t>(i, 0, static_cast<int64_t>(values.size()) - 1))];
        }
      } else if (resample || std::holds_alternative<std::string>(v)) {
        v = domain.sample(rng_);
      } else {
        const double factor = u(rng_) < 0.5 ? 1.2 : 0.8;
        if (const auto* i = std::get_if<int64_t>(&v)) {
          v = static_cast<int64_t>(static_cast<double>(*i) * factor);
        } else {
          v = std::get<double>(v) * factor;
        }
      }
    }
    return config;
  }

  int64_t max_t_, interval_;
  double quantile_, resample_;
  int64_t population_, slots_;
  std::mt19937_64 rng_;
  std::map<std::string, Domain> mutations_;
  std::map<int64_t, State> trials_;
  std::set<int64_t> paused_;   // paused at a perturbation point, not promoted yet
  std::set<int64_t> waiting_;  // paused or promoted, not started again yet
  std::map<int64_t, Exploit> exploits_;
  int64_t last_rung_ = 0;
};

}  // namespace

std::unique_ptr<Scheduler> make_pbt(const SchedulerOptions& o) {
  TORCH_CHECK(o.perturbation_interval() >= 1, "tune: --perturbation-interval must be >= 1, got ",
              o.perturbation_interval());
  TORCH_CHECK(o.quantile_fraction() >= 0 && o.quantile_fraction() <= 0.5,
              "tune: --quantile-fraction must be between 0 and 0.5, got ", o.quantile_fraction());
  TORCH_CHECK(o.resample_probability() >= 0 && o.resample_probability() <= 1,
              "tune: --resample-probability must be between 0 and 1, got ",
              o.resample_probability());
  TORCH_CHECK(!o.mutations().empty(),
              "tune: --scheduler pbt needs at least one --mutation NAME=DISTRIBUTION (what "
              "explore changes, as 'lr=loguniform(1e-4, 1e-1)')");
  return std::make_unique<Pbt>(o);
}

void check_mutations(const SchedulerOptions& o, const SearchSpace& space) {
  std::string names;
  for (const auto& p : space.params()) {
    names += (names.empty() ? "" : ", ") + p.first;
  }
  for (const std::string& name : mutation_names(o)) {
    const auto& params = space.params();
    TORCH_CHECK(
        std::any_of(params.begin(), params.end(), [&](const auto& p) { return p.first == name; }),
        "tune: --mutation ", name, ": the search space has no parameter '", name, "' (it has ",
        names, "); a mutation perturbs a parameter of the space");
  }
}

bool has_files(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    return false;
  }
  bool found = false;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") {
      continue;
    }
    struct stat st;
    const std::string path = dir + "/" + name;
    if (::lstat(path.c_str(), &st) == 0 && (S_ISDIR(st.st_mode) ? has_files(path) : true)) {
      found = true;
      break;
    }
  }
  ::closedir(d);
  return found;
}

void stage_copy(const std::string& from, const std::string& staged) {
  std::string why = paratrain::detail::remove_tree(staged);
  TORCH_CHECK(why.empty(), "tune: cannot remove ", why);
  why = paratrain::detail::copy_tree(from, staged);
  TORCH_CHECK(why.empty(), "tune: cannot copy the checkpoint ", from, ": ", why);
}

void restore_aside(const std::string& to) {
  const std::string old = to + ".old";
  struct stat st;
  if (::lstat(to.c_str(), &st) != 0 && ::lstat(old.c_str(), &st) == 0) {
    ::rename(old.c_str(), to.c_str());  // a swap interrupted between its two renames
  }
}

void swap_in(const std::string& staged, const std::string& to) {
  const std::string old = to + ".old";
  restore_aside(to);
  const std::string why = paratrain::detail::remove_tree(old);
  TORCH_CHECK(why.empty(), "tune: cannot remove ", why);
  TORCH_CHECK(::rename(to.c_str(), old.c_str()) == 0 || errno == ENOENT, "tune: cannot move ", to,
              " aside: ", std::strerror(errno));
  TORCH_CHECK(::rename(staged.c_str(), to.c_str()) == 0, "tune: cannot rename ", staged, " to ", to,
              ": ", std::strerror(errno));
  paratrain::detail::remove_tree(old);
}

std::vector<std::string> mutation_names(const SchedulerOptions& o) {
  std::vector<std::string> names;
  for (const std::string& m : o.mutations()) {
    names.push_back(m.substr(0, m.find('=')));
  }
  return names;
}

}  // namespace tune
}  // namespace paratrain
