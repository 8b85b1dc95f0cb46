// The searchers of searcher.h. TPE and BOHB follow Optuna's and HpBandSter's published
// algorithms and defaults; the code is ours.

#include "limits.h"
#include "paratrain/tune/searcher.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>

namespace paratrain {
namespace tune {

void Searcher::on_result(int64_t, const Config&, int64_t, double) {}
void Searcher::on_complete(int64_t, const Config&, Outcome, double) {}
void Searcher::on_rung(int64_t, const Config&, int64_t, double) {}

namespace {

// Each trial's draws come from its own stream, so a trial's config does not depend on how many
// draws earlier trials made, and a resumed study proposes what a fresh one would.
std::mt19937_64 trial_rng(uint64_t seed, int64_t number, uint32_t salt) {
  std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                    static_cast<uint32_t>(number), static_cast<uint32_t>(number >> 32), salt};
  return std::mt19937_64(seq);
}

Config sample_all(const SearchSpace& space, std::mt19937_64& rng) {
  Config c;
  for (const auto& [name, domain] : space.params()) {
    c[name] = domain.sample(rng);
  }
  return c;
}

// ---- grid and random: Ray Tune's BasicVariantGenerator ----
class BasicSearcher : public Searcher {
 public:
  BasicSearcher(SearchSpace space, SearcherOptions o) : space_(std::move(space)), o_(o) {}
  std::optional<Config> suggest(int64_t number) override {
    const int64_t grid = space_.grid_size();
    if (number >= grid * o_.num_samples()) {
      return std::nullopt;
    }
    auto rng = trial_rng(o_.seed(), number, 1);
    Config c = sample_all(space_, rng);
    int64_t index = number % grid;  // the last grid parameter changes fastest
    const auto& params = space_.params();
    for (auto it = params.rbegin(); it != params.rend(); ++it) {
      if (it->second.kind() == Domain::Kind::kGrid) {
        const auto& values = it->second.values();
        const int64_t n = static_cast<int64_t>(values.size());
        c[it->first] = values[index % n];
        index /= n;
      }
    }
    return c;
  }

 private:
  SearchSpace space_;
  SearcherOptions o_;
};

// The coordinates the model-based searchers work in: log for log scales, and integers widened
// by half a step on each side so that each integer owns an equal share (Optuna's IntDistribution).
struct Axis {
  double lo = 0, hi = 0;
};

Axis axis_of(const Domain& d) {
  switch (d.kind()) {
    case Domain::Kind::kLogUniform:
      return {std::log(d.low()), std::log(d.high())};
    case Domain::Kind::kQLogUniform:
      return {std::log(d.low()), std::log(d.high())};
    case Domain::Kind::kRandInt:
      return {d.low() - 0.5, d.high() - 0.5};
    default:
      return {d.low(), d.high()};
  }
}

double encode(const Domain& d, const Value& v) {
  const double x = to_double(v);
  return d.log_scale() ? std::log(std::max(x, d.low())) : x;
}

Value decode(const Domain& d, double x) {
  return d.from_double(d.log_scale() ? std::exp(x) : x);
}

size_t category_of(const Domain& d, const Value& v) {
  const auto& values = d.values();
  for (size_t i = 0; i < values.size(); ++i) {
    if (values[i] == v) {
      return i;
    }
  }
  return 0;  // a stored value the space no longer has: the study check prevents this
}

double normal_cdf(double z) {
  return 0.5 * std::erfc(-z / std::sqrt(2.0));
}

double truncated_normal(std::mt19937_64& rng, double mu, double sigma, double lo, double hi) {
  std::normal_distribution<double> n(mu, sigma);
  for (int i = 0; i < 1000; ++i) {  // the mean lies in [lo, hi], so most draws land inside
    const double x = n(rng);
    if (x >= lo && x <= hi) {
      return x;
    }
  }
  return std::clamp(mu, lo, hi);
}

// ---- TPE ----

// Optuna's default_gamma and default_weights.
int64_t tpe_gamma(int64_t n) {
  return std::min<int64_t>(static_cast<int64_t>(std::ceil(0.1 * static_cast<double>(n))), 25);
}

std::vector<double> tpe_weights(int64_t n) {
  std::vector<double> w(static_cast<size_t>(n), 1.0);
  if (n >= 25) {  // older trials ramp up from 1/n to 1; the newest 25 weigh 1
    const int64_t ramp = n - 25;
    for (int64_t i = 0; i < ramp; ++i) {
      w[static_cast<size_t>(i)] =
          ramp == 1 ? 1.0 / static_cast<double>(n)
                    : 1.0 / static_cast<double>(n) + (1.0 - 1.0 / static_cast<double>(n)) *
                                                         static_cast<double>(i) /
                                                         static_cast<double>(ramp - 1);
    }
  }
  return w;
}

// A univariate Parzen estimator: a truncated Gaussian mixture with Optuna's bandwidths (the
// larger gap to a neighbour, magic clip) and a prior component, or a categorical distribution.
class Parzen {
 public:
  Parzen(const Domain& d, const std::vector<Value>& observed, const std::vector<double>& weights)
      : domain_(d), axis_(axis_of(d)) {
    const double prior_weight = 1.0;
    if (d.categorical()) {
      const size_t n = d.values().size();
      probs_.assign(n, prior_weight / static_cast<double>(n));
      for (size_t i = 0; i < observed.size(); ++i) {
        probs_[category_of(d, observed[i])] += weights[i];
      }
      const double total = std::accumulate(probs_.begin(), probs_.end(), 0.0);
      for (auto& p : probs_) {
        p /= total;
      }
      return;
    }
    std::vector<double> mus;
    for (const auto& v : observed) {
      mus.push_back(encode(d, v));
    }
    weights_ = weights;
    const double range = axis_.hi - axis_.lo;
    mus.push_back(0.5 * (axis_.lo + axis_.hi));  // the prior
    weights_.push_back(prior_weight);
    std::vector<size_t> order(mus.size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return mus[a] < mus[b]; });
    std::vector<double> ends{axis_.lo};
    for (size_t i : order) {
      ends.push_back(mus[i]);
    }
    ends.push_back(axis_.hi);
    std::vector<double> sorted_sigma(mus.size());
    for (size_t k = 0; k < mus.size(); ++k) {
      sorted_sigma[k] = std::max(ends[k + 1] - ends[k], ends[k + 2] - ends[k + 1]);
    }
    if (ends.size() >= 4) {  // consider_endpoints=False: the outermost use their inner gap
      sorted_sigma.front() = ends[2] - ends[1];
      sorted_sigma.back() = ends[ends.size() - 2] - ends[ends.size() - 3];
    }
    sigmas_.assign(mus.size(), 0);
    const double min_sigma = range / std::min(100.0, 1.0 + static_cast<double>(mus.size()));
    for (size_t k = 0; k < mus.size(); ++k) {
      sigmas_[order[k]] = std::clamp(sorted_sigma[k], min_sigma, range);
    }
    sigmas_.back() = range;  // the prior's sigma
    mus_ = mus;
    const double total = std::accumulate(weights_.begin(), weights_.end(), 0.0);
    for (auto& w : weights_) {
      w /= total;
    }
  }

  // A draw, in the estimator's coordinates (a category's index for categorical domains).
  double sample(std::mt19937_64& rng) const {
    if (domain_.categorical()) {
      std::discrete_distribution<size_t> pick(probs_.begin(), probs_.end());
      return static_cast<double>(pick(rng));
    }
    std::discrete_distribution<size_t> pick(weights_.begin(), weights_.end());
    const size_t k = pick(rng);
    return truncated_normal(rng, mus_[k], sigmas_[k], axis_.lo, axis_.hi);
  }

  double log_pdf(double x) const {
    if (domain_.categorical()) {
      return std::log(probs_[static_cast<size_t>(x)]);
    }
    double total = 0;
    for (size_t k = 0; k < mus_.size(); ++k) {
      const double s = sigmas_[k];
      const double z = (x - mus_[k]) / s;
      const double mass =
          normal_cdf((axis_.hi - mus_[k]) / s) - normal_cdf((axis_.lo - mus_[k]) / s);
      total += weights_[k] * std::exp(-0.5 * z * z) / (s * std::sqrt(2 * M_PI) * mass);
    }
    return std::log(std::max(total, 1e-300));
  }

 private:
  const Domain& domain_;
  Axis axis_;
  std::vector<double> mus_, sigmas_, weights_, probs_;
};

class TpeSearcher : public Searcher {
 public:
  TpeSearcher(SearchSpace space, SearcherOptions o) : space_(std::move(space)), o_(o) {}

  void on_result(int64_t number, const Config&, int64_t budget, double loss) override {
    last_[number] = {budget, loss};
  }

  void on_complete(int64_t number, const Config& config, Outcome outcome, double loss) override {
    if (outcome == Outcome::kFailed) {
      return;  // Optuna leaves failed trials out of the model
    }
    Obs o{number, config, outcome == Outcome::kComplete, 0, loss};
    if (!o.complete) {
      auto it = last_.find(number);
      if (it == last_.end()) {
        return;  // pruned before any result: nothing to learn
      }
      o.step = it->second.first;
      o.loss = it->second.second;
    }
    if (std::isfinite(o.loss)) {
      done_[number] = o;
    }
  }

  std::optional<Config> suggest(int64_t number) override {
    auto rng = trial_rng(o_.seed(), number, 2);
    const int64_t n = static_cast<int64_t>(done_.size());
    if (n < o_.n_startup_trials()) {
      return sample_all(space_, rng);
    }
    // Optuna's split: complete trials by value first, then pruned ones by later step, then value.
    std::vector<const Obs*> ranked;
    for (const auto& kv : done_) {
      ranked.push_back(&kv.second);
    }
    std::stable_sort(ranked.begin(), ranked.end(), [](const Obs* a, const Obs* b) {
      if (a->complete != b->complete) {
        return a->complete;
      }
      if (!a->complete && a->step != b->step) {
        return a->step > b->step;
      }
      return a->loss < b->loss;
    });
    const size_t n_below = static_cast<size_t>(tpe_gamma(n));
    std::vector<const Obs*> below(ranked.begin(), ranked.begin() + n_below);
    std::vector<const Obs*> above(ranked.begin() + n_below, ranked.end());
    auto by_number = [](const Obs* a, const Obs* b) { return a->number < b->number; };
    std::sort(below.begin(), below.end(), by_number);  // the weights ramp with trial age
    std::sort(above.begin(), above.end(), by_number);
    Config c;
    for (const auto& [name, domain] : space_.params()) {
      c[name] = sample_param(name, domain, below, above, rng);
    }
    return c;
  }

 private:
  struct Obs {
    int64_t number;
    Config config;
    bool complete;
    int64_t step;
    double loss;
  };

  Value sample_param(const std::string& name,
                     const Domain& domain,
                     const std::vector<const Obs*>& below,
                     const std::vector<const Obs*>& above,
                     std::mt19937_64& rng) const {
    auto values = [&](const std::vector<const Obs*>& set) {
      std::vector<Value> v;
      for (const Obs* o : set) {
        v.push_back(o->config.at(name));
      }
      return v;
    };
    const Parzen l(domain, values(below), tpe_weights(static_cast<int64_t>(below.size())));
    const Parzen g(domain, values(above), tpe_weights(static_cast<int64_t>(above.size())));
    double best_x = 0, best_score = -kInf;
    for (int64_t i = 0; i < o_.n_ei_candidates(); ++i) {
      const double x = l.sample(rng);
      const double score = l.log_pdf(x) - g.log_pdf(x);
      if (score > best_score) {
        best_score = score;
        best_x = x;
      }
    }
    if (domain.categorical()) {
      return domain.values()[static_cast<size_t>(best_x)];
    }
    return decode(domain, best_x);
  }

  SearchSpace space_;
  SearcherOptions o_;
  std::map<int64_t, std::pair<int64_t, double>> last_;
  std::map<int64_t, Obs> done_;
};

// ---- BOHB ----

// A product-kernel density as statsmodels' KDEMultivariate with bw='normal_reference':
// Gaussian kernels on the continuous axes (in [0, 1]), Aitchison-Aitken on the categorical ones.
struct Kde {
  std::vector<std::vector<double>> data;
  std::vector<double> bw;

  double pdf(const std::vector<double>& x, const std::vector<size_t>& levels) const {
    double total = 0;
    for (const auto& row : data) {
      double k = 1;
      for (size_t j = 0; j < x.size(); ++j) {
        if (levels[j] == 0) {
          const double z = (x[j] - row[j]) / bw[j];
          k *= std::exp(-0.5 * z * z) / (std::sqrt(2 * M_PI) * bw[j]);
        } else {
          k *= x[j] == row[j] ? 1 - bw[j] : bw[j] / static_cast<double>(levels[j] - 1);
        }
      }
      total += k;
    }
    return total / static_cast<double>(data.size());
  }
};

class BohbSearcher : public Searcher {
 public:
  BohbSearcher(SearchSpace space, SearcherOptions o) : space_(std::move(space)), o_(o) {
    for (const auto& p : space_.params()) {
      levels_.push_back(p.second.categorical() ? p.second.values().size() : 0);
    }
  }

  void on_rung(int64_t, const Config& config, int64_t budget, double loss) override {
    if (!models_.empty() && models_.rbegin()->first > budget) {
      return;  // HpBandSter: no point refining a model below the largest one
    }
    if (!std::isfinite(loss)) {
      loss = kInf;
    }
    auto& obs = observations_[budget];
    obs.emplace_back(to_unit(config), loss);
    build(budget);
  }

  std::optional<Config> suggest(int64_t number) override {
    auto rng = trial_rng(o_.seed(), number, 3);
    std::uniform_real_distribution<double> u(0, 1);
    if (models_.empty() || u(rng) < o_.random_fraction()) {
      return sample_all(space_, rng);
    }
    const auto& [good, bad] = models_.rbegin()->second;
    std::uniform_int_distribution<size_t> pick(0, good.data.size() - 1);
    double best = kInf;
    std::vector<double> best_x;
    for (int64_t i = 0; i < o_.num_samples_kde(); ++i) {
      const auto& datum = good.data[pick(rng)];
      std::vector<double> x(datum.size());
      for (size_t j = 0; j < x.size(); ++j) {
        const double bw = std::max(good.bw[j], o_.min_bandwidth());
        if (levels_[j] == 0) {
          x[j] = truncated_normal(rng, datum[j], o_.bandwidth_factor() * bw, 0, 1);
        } else if (u(rng) < 1 - bw) {
          x[j] = datum[j];
        } else {
          x[j] = static_cast<double>(std::uniform_int_distribution<size_t>(0, levels_[j] - 1)(rng));
        }
      }
      const double score =
          std::max(1e-32, bad.pdf(x, levels_)) / std::max(good.pdf(x, levels_), 1e-32);
      if (score < best) {
        best = score;
        best_x = x;
      }
    }
    if (best_x.empty()) {
      return sample_all(space_, rng);
    }
    return from_unit(best_x);
  }

 private:
  std::vector<double> to_unit(const Config& config) const {
    std::vector<double> x;
    for (const auto& [name, domain] : space_.params()) {
      const Value& v = config.at(name);
      if (domain.categorical()) {
        x.push_back(static_cast<double>(category_of(domain, v)));
      } else {
        const Axis a = axis_of(domain);
        x.push_back(std::clamp((encode(domain, v) - a.lo) / (a.hi - a.lo), 0.0, 1.0));
      }
    }
    return x;
  }

  Config from_unit(const std::vector<double>& x) const {
    Config c;
    size_t j = 0;
    for (const auto& [name, domain] : space_.params()) {
      if (domain.categorical()) {
        c[name] = domain.values()[static_cast<size_t>(x[j])];
      } else {
        const Axis a = axis_of(domain);
        c[name] = decode(domain, a.lo + x[j] * (a.hi - a.lo));
      }
      ++j;
    }
    return c;
  }

  // HpBandSter's new_result: good and bad sets from the sorted losses, normal-reference
  // bandwidths clipped from below by min_bandwidth.
  void build(int64_t budget) {
    auto obs = observations_[budget];
    const size_t d = levels_.size();
    const size_t min_points = d + 1;
    const size_t n = obs.size();
    if (n < min_points) {
      return;
    }
    std::stable_sort(obs.begin(), obs.end(),
                     [](const auto& a, const auto& b) { return a.second < b.second; });
    const size_t n_good = std::max(
        min_points, static_cast<size_t>(o_.top_n_percent() * static_cast<double>(n) / 100));
    const size_t n_bad = std::max(
        min_points, static_cast<size_t>((100 - o_.top_n_percent()) * static_cast<double>(n) / 100));
    Kde good, bad;
    for (size_t i = 0; i < n && i < n_good; ++i) {
      good.data.push_back(obs[i].first);
    }
    for (size_t i = n_good; i < n && i < n_good + n_bad; ++i) {
      bad.data.push_back(obs[i].first);
    }
    if (good.data.size() <= d || bad.data.size() <= d) {
      return;
    }
    good.bw = bandwidths(good.data);
    bad.bw = bandwidths(bad.data);
    models_[budget] = {good, bad};
  }

  std::vector<double> bandwidths(const std::vector<std::vector<double>>& data) const {
    const size_t d = levels_.size();
    const double n = static_cast<double>(data.size());
    std::vector<double> bw(d);
    for (size_t j = 0; j < d; ++j) {
      double mean = 0, var = 0;
      for (const auto& row : data) {
        mean += row[j] / n;
      }
      for (const auto& row : data) {
        var += (row[j] - mean) * (row[j] - mean) / n;
      }
      bw[j] = std::max(1.06 * std::sqrt(var) * std::pow(n, -1.0 / (4.0 + static_cast<double>(d))),
                       o_.min_bandwidth());
      if (levels_[j] > 0) {
        bw[j] = std::min(bw[j], 1.0);  // Aitchison-Aitken needs lambda <= 1 for a density
      }
    }
    return bw;
  }

  SearchSpace space_;
  SearcherOptions o_;
  std::vector<size_t> levels_;
  std::map<int64_t, std::vector<std::pair<std::vector<double>, double>>> observations_;
  std::map<int64_t, std::pair<Kde, Kde>> models_;
};

}  // namespace

std::unique_ptr<Searcher> make_searcher(const SearchSpace& space, const SearcherOptions& o) {
  TORCH_CHECK(!space.empty(), "tune: the search space is empty; give --space NAME=DISTRIBUTION");
  const std::string& kind = o.kind();
  if (kind == "grid" || kind == "random") {
    TORCH_CHECK(o.num_samples() >= 1, "tune: num_samples must be >= 1, got ", o.num_samples());
    return std::make_unique<BasicSearcher>(space, o);
  }
  TORCH_CHECK(kind == "tpe" || kind == "bohb", "tune: unknown searcher '", kind,
              "'; use grid, random, tpe or bohb");
  for (const auto& p : space.params()) {
    TORCH_CHECK(p.second.kind() != Domain::Kind::kGrid, "tune: ", p.first,
                "=grid_search(...) needs the grid (or random) searcher, not ", kind);
  }
  if (kind == "tpe") {
    return std::make_unique<TpeSearcher>(space, o);
  }
  return std::make_unique<BohbSearcher>(space, o);
}

}  // namespace tune
}  // namespace paratrain
