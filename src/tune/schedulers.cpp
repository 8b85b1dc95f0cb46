// The schedulers of scheduler.h. ASHA and the median rule follow Ray Tune's documented rules,
// Hyperband's brackets HpBandSter's; the code is ours.

#include "limits.h"
#include "paratrain/tune/scheduler.h"
#include "pbt.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>

namespace paratrain {
namespace tune {

void Scheduler::on_trial_add(int64_t) {}
void Scheduler::on_trial_end(int64_t, double) {}
void Scheduler::on_no_more_trials() {}
std::vector<int64_t> Scheduler::take_promoted() {
  return {};
}
std::vector<int64_t> Scheduler::take_dropped() {
  return {};
}
int64_t Scheduler::last_rung() const {
  return 0;
}
void Scheduler::on_config(int64_t, const Config&) {}
void Scheduler::observe(int64_t number, int64_t iteration, double loss) {
  on_result(number, iteration, loss);
}
void Scheduler::on_paused(int64_t) {}
void Scheduler::on_start(int64_t) {}
std::optional<Exploit> Scheduler::take_exploit(int64_t) {
  return std::nullopt;
}

namespace {

// numpy.nanpercentile's default (linear) interpolation, q in [0, 100], over the finite values
// (an infinity would make the interpolation NaN); NaN when there are none.
double percentile(std::vector<double> v, double q) {
  v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return !std::isfinite(x); }), v.end());
  if (v.empty()) {
    return std::nan("");
  }
  std::sort(v.begin(), v.end());
  const double pos = q / 100.0 * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (pos - static_cast<double>(lo)) * (v[hi] - v[lo]);
}

class Fifo : public Scheduler {
 public:
  explicit Fifo(int64_t max_t) : max_t_(max_t) {}
  Decision on_result(int64_t, int64_t iteration, double) override {
    const bool done = max_t_ > 0 && iteration >= max_t_;
    last_rung_ = done ? iteration : 0;
    return done ? Decision::kComplete : Decision::kContinue;
  }
  int64_t last_rung() const override { return last_rung_; }

 private:
  int64_t max_t_;
  int64_t last_rung_ = 0;
};

class Asha : public Scheduler {
 public:
  Asha(int64_t max_t, int64_t grace, double rf) : max_t_(max_t), rf_(rf) {
    // Ray: max_rungs = int(log(max_t / grace_period) / log(rf) + 1), milestones grace * rf^k
    const int rungs =
        static_cast<int>(std::log(static_cast<double>(max_t) / grace) / std::log(rf) + 1 + 1e-9);
    for (int k = rungs - 1; k >= 0; --k) {
      rungs_.push_back({static_cast<double>(grace) * std::pow(rf, k), {}});
    }
  }
  Decision on_result(int64_t number, int64_t iteration, double loss) override {
    last_rung_ = 0;
    if (iteration >= max_t_) {
      last_rung_ = max_t_;
      return Decision::kComplete;
    }
    const double reward = -loss;  // Ray compares metric * mode_sign, higher is better
    for (auto& [milestone, recorded] : rungs_) {
      if (static_cast<double>(iteration) < milestone || recorded.count(number)) {
        continue;
      }
      Decision d = Decision::kContinue;
      if (!recorded.empty()) {
        std::vector<double> values;
        for (const auto& kv : recorded) {
          values.push_back(kv.second);
        }
        const double cutoff = percentile(values, (1 - 1 / rf_) * 100);
        if (!std::isnan(cutoff) && !(reward >= cutoff)) {  // a NaN reward is below any cutoff
          d = Decision::kStop;
        }
      }
      recorded[number] = reward;  // NaN or -inf: left out of later cutoffs, as nanpercentile
      // The rung's budget for BOHB: its milestone, the same for every trial recorded there.
      last_rung_ = static_cast<int64_t>(std::ceil(milestone - 1e-9));
      return d;
    }
    return Decision::kContinue;
  }
  int64_t last_rung() const override { return last_rung_; }

 private:
  int64_t max_t_;
  double rf_;
  int64_t last_rung_ = 0;
  std::vector<std::pair<double, std::map<int64_t, double>>> rungs_;
};

class Median : public Scheduler {
 public:
  Median(int64_t max_t, int64_t grace, int64_t min_samples)
      : max_t_(max_t), grace_(grace), min_samples_(min_samples) {}
  Decision on_result(int64_t number, int64_t iteration, double loss) override {
    results_[number].emplace_back(iteration, -loss);
    last_rung_ = 0;
    if (max_t_ > 0 && iteration >= max_t_) {
      last_rung_ = iteration;
      return Decision::kComplete;
    }
    if (iteration <= grace_) {
      return Decision::kContinue;
    }
    std::vector<double> means;
    for (const auto& [other, rows] : results_) {
      if (other == number || rows.back().first < iteration) {
        continue;
      }
      double sum = 0;
      int count = 0;
      for (const auto& [t, r] : rows) {
        if (t <= iteration) {
          sum += r;
          ++count;
        }
      }
      if (count > 0 && std::isfinite(sum)) {
        means.push_back(sum / count);
      }
    }
    if (static_cast<int64_t>(means.size()) < min_samples_) {
      return Decision::kContinue;
    }
    double best = -kInf;
    for (const auto& row : results_[number]) {
      best = std::isnan(row.second) ? best : std::max(best, row.second);
    }
    const double median = percentile(means, 50);
    return !std::isnan(median) && best < median ? Decision::kStop : Decision::kContinue;
  }
  int64_t last_rung() const override { return last_rung_; }

 private:
  int64_t max_t_, grace_, min_samples_;
  int64_t last_rung_ = 0;
  std::map<int64_t, std::vector<std::pair<int64_t, double>>> results_;
};

class Hyperband : public Scheduler {
 public:
  Hyperband(int64_t max_t, int64_t grace, double eta) : max_t_(max_t), eta_(eta) {
    s_max_ = static_cast<int>(std::floor(
        std::log(static_cast<double>(max_t) / static_cast<double>(grace)) / std::log(eta) + 1e-9));
  }

  // Brackets take consecutive trial numbers, so that every tuner sharing a study (each learning
  // of the others' trials in its own order) puts each trial in the same bracket.
  void on_trial_add(int64_t number) override {
    size_t k = 0;
    int64_t start = 0;
    while (true) {
      if (k == brackets_.size()) {
        open_bracket(start);
      }
      const Bracket& b = brackets_[k];
      if (number < b.start + b.capacity) {
        break;
      }
      start = b.start + b.capacity;
      ++k;
    }
    Bracket& b = brackets_[k];
    b.rungs[0].members.insert(number);
    where_[number] = k;
    if (static_cast<int64_t>(b.rungs[0].members.size()) >= b.capacity) {
      b.closed = true;
      for (size_t r = 0; r < b.rungs.size(); ++r) {
        settle(b, r);
      }
    }
  }

  Decision on_result(int64_t number, int64_t iteration, double loss) override {
    last_rung_ = 0;
    Bracket& b = brackets_[where_.at(number)];
    size_t r = rung_of(b, number);
    // A trial reporting beyond a rung it has a result in was promoted (by another tuner, or
    // before this tuner resumed the study): it belongs to the next rung.
    while (b.rungs[r].results.count(number) && iteration > b.rungs[r].budget &&
           r + 1 < b.rungs.size()) {
      b.rungs[r].paused.erase(number);
      b.rungs[r + 1].members.insert(number);
      ++r;
    }
    Rung& rung = b.rungs[r];
    if (rung.results.count(number) || (iteration < rung.budget && iteration < max_t_)) {
      return Decision::kContinue;  // a rung keeps the first result at or past its budget
    }
    rung.results[number] = std::isfinite(loss) ? loss : kInf;
    const bool last = r + 1 == b.rungs.size() || iteration >= max_t_;
    if (!last) {
      rung.paused.insert(number);
    }
    settle(b, r);
    last_rung_ = iteration;
    return last ? Decision::kComplete : Decision::kPause;
  }
  int64_t last_rung() const override { return last_rung_; }

  void on_trial_end(int64_t number, double loss) override {
    auto it = where_.find(number);
    if (it == where_.end()) {
      return;
    }
    Bracket& b = brackets_[it->second];
    const size_t r = rung_of(b, number);
    Rung& rung = b.rungs[r];
    if (!rung.results.count(number)) {
      rung.results[number] = std::isfinite(loss) ? loss : kInf;  // ended before its milestone
    }
    rung.paused.erase(number);
    settle(b, r);
  }

  void on_no_more_trials() override {
    for (auto& b : brackets_) {
      if (!b.closed) {
        b.closed = true;
        const int64_t have = static_cast<int64_t>(b.rungs[0].members.size());
        for (size_t i = 0; i < b.rungs.size(); ++i) {  // shrink the rungs in proportion
          b.rungs[i].size = std::max<int64_t>(
              1, static_cast<int64_t>(static_cast<double>(have) / std::pow(eta_, i)));
        }
        b.rungs[0].size = have;
        for (size_t r = 0; r < b.rungs.size(); ++r) {
          settle(b, r);
        }
      }
    }
  }

  std::vector<int64_t> take_promoted() override { return std::exchange(promoted_, {}); }
  std::vector<int64_t> take_dropped() override { return std::exchange(dropped_, {}); }

 private:
  struct Rung {
    int64_t budget = 0;
    int64_t size = 0;  // trials this rung takes
    std::set<int64_t> members;
    std::map<int64_t, double> results;
    std::set<int64_t> paused;
    bool done = false;
  };
  struct Bracket {
    std::vector<Rung> rungs;
    int64_t start = 0, capacity = 0;  // its trial numbers: [start, start + capacity)
    bool closed = false;
  };

  // HpBandSter's iteration i: s = s_max - i mod (s_max + 1), n0 = floor((s_max + 1) / (s + 1))
  // * eta^s, rung k has max(floor(n0 eta^-k), 1) trials at budget max_t eta^(k - s).
  void open_bracket(int64_t start) {
    const int s = s_max_ - static_cast<int>(brackets_.size() % (s_max_ + 1));
    const double n0 = std::floor(static_cast<double>(s_max_ + 1) / (s + 1)) * std::pow(eta_, s);
    Bracket b;
    b.start = start;
    b.capacity = std::max<int64_t>(1, static_cast<int64_t>(n0));
    for (int k = 0; k <= s; ++k) {
      Rung rung;
      rung.size = std::max<int64_t>(1, static_cast<int64_t>(n0 * std::pow(eta_, -k)));
      rung.budget = std::max<int64_t>(
          1, static_cast<int64_t>(std::round(static_cast<double>(max_t_) * std::pow(eta_, k - s))));
      b.rungs.push_back(rung);
    }
    brackets_.push_back(b);
  }

  static size_t rung_of(const Bracket& b, int64_t number) {
    for (size_t r = b.rungs.size(); r-- > 0;) {
      if (b.rungs[r].members.count(number)) {
        return r;
      }
    }
    TORCH_CHECK(false, "hyperband: trial ", number, " is in no rung");
  }

  // When every member of a full rung has a result, the best go up and the other paused ones stop.
  void settle(Bracket& b, size_t r) {
    Rung& rung = b.rungs[r];
    if (rung.done || !b.closed || static_cast<int64_t>(rung.members.size()) < rung.size ||
        rung.results.size() < rung.members.size()) {
      return;
    }
    rung.done = true;
    if (r + 1 == b.rungs.size()) {
      return;
    }
    struct SettleNext {  // the next rung may have all its results already (a replayed study)
      Hyperband* self;
      Bracket& b;
      size_t r;
      ~SettleNext() { self->settle(b, r + 1); }
    } settle_next{this, b, r};
    std::vector<std::pair<double, int64_t>> ranked;
    for (const auto& [number, loss] : rung.results) {
      ranked.emplace_back(loss, number);
    }
    std::sort(ranked.begin(), ranked.end());
    Rung& next = b.rungs[r + 1];
    for (const auto& [loss, number] : ranked) {
      const bool waiting = rung.paused.count(number) > 0 && !next.members.count(number);
      if (waiting && static_cast<int64_t>(next.members.size()) < next.size) {
        next.members.insert(number);
        promoted_.push_back(number);
      } else if (waiting) {
        dropped_.push_back(number);
      }
    }
    rung.paused.clear();
    next.size = static_cast<int64_t>(next.members.size());  // ended trials leave their places
    if (next.members.empty()) {
      for (size_t k = r + 1; k < b.rungs.size(); ++k) {
        b.rungs[k].done = true;
      }
    }
  }

  int64_t max_t_;
  double eta_;
  int s_max_ = 0;
  int64_t last_rung_ = 0;
  std::vector<Bracket> brackets_;
  std::map<int64_t, size_t> where_;
  std::vector<int64_t> promoted_, dropped_;
};

}  // namespace

int64_t effective_max_t(const SchedulerOptions& o) {
  if (o.max_t() > 0) {
    return o.max_t();
  }
  return o.kind() == "asha" ? 100 : o.kind() == "hyperband" ? 81 : 0;
}

std::unique_ptr<Scheduler> make_scheduler(const SchedulerOptions& o) {
  const std::string& kind = o.kind();
  TORCH_CHECK(
      kind == "fifo" || kind == "asha" || kind == "hyperband" || kind == "median" || kind == "pbt",
      "tune: unknown scheduler '", kind, "'; use fifo, asha, hyperband, median or pbt");
  TORCH_CHECK(o.max_t() >= 0, "tune: max_t must be >= 0, got ", o.max_t());
  TORCH_CHECK(o.grace_period() >= 1, "tune: grace_period must be >= 1, got ", o.grace_period());
  const int64_t max_t = effective_max_t(o);
  if (kind == "pbt") {
    return make_pbt(o);
  }
  if (kind == "fifo") {
    return std::make_unique<Fifo>(max_t);
  }
  if (kind == "median") {
    TORCH_CHECK(o.min_samples_required() >= 1, "tune: min_samples_required must be >= 1, got ",
                o.min_samples_required());
    return std::make_unique<Median>(max_t, o.grace_period(), o.min_samples_required());
  }
  const double rf = o.reduction_factor() > 0 ? o.reduction_factor() : kind == "asha" ? 4 : 3;
  TORCH_CHECK(rf > 1, "tune: reduction_factor must be > 1, got ", rf);
  TORCH_CHECK(max_t >= o.grace_period(), "tune: max_t (", max_t, ") must be >= grace_period (",
              o.grace_period(), ")");
  if (kind == "asha") {
    return std::make_unique<Asha>(max_t, o.grace_period(), rf);
  }
  return std::make_unique<Hyperband>(max_t, o.grace_period(), rf);
}

}  // namespace tune
}  // namespace paratrain
