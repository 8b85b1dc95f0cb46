#pragma once

// paratrain::tune search spaces, with Ray Tune's names and semantics (ray.tune.uniform, ...):
//
//   uniform(low, high)          a float in [low, high)
//   quniform(low, high, q)      uniform, rounded to a multiple of q
//   loguniform(low, high)       a float whose log is uniform in [log low, log high); low > 0
//   qloguniform(low, high, q)   loguniform, rounded to a multiple of q
//   randint(low, high)          an integer in [low, high): high is exclusive, as in Ray Tune
//   choice(a, b, ...)           one of the values, each equally likely
//   grid_search(a, b, ...)      every value in turn (the grid searcher's axes; others sample them)
//
//   SearchSpace space;
//   space.add("lr", Domain::parse("loguniform(1e-4, 1e-1)"));
//   space.add("batch_size", Domain::choice({32, 64, 128}));

#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace paratrain {
namespace tune {

/// A sampled value: integers (randint, integer choices), floats, or strings (choice("sgd", ...)).
using Value = std::variant<int64_t, double, std::string>;

/// A trial's parameters, name -> value.
using Config = std::map<std::string, Value>;

/// The value as a command-line word or an environment variable: 64, 0.001, sgd. Floats use the
/// shortest text that reads back to the same double.
std::string to_string(const Value& value);

/// The value as a double (integers converted); throws for strings.
double to_double(const Value& value);

/// "lr=0.001 hidden=128".
std::string to_string(const Config& config);

class Domain {
 public:
  enum class Kind { kUniform, kQUniform, kLogUniform, kQLogUniform, kRandInt, kChoice, kGrid };

  static Domain uniform(double low, double high);
  static Domain quniform(double low, double high, double q);
  static Domain loguniform(double low, double high);
  static Domain qloguniform(double low, double high, double q);
  static Domain randint(int64_t low, int64_t high);
  static Domain choice(std::vector<Value> values);
  static Domain grid_search(std::vector<Value> values);
  /// "loguniform(1e-3, 0.3)", "choice(128, 256)", "grid_search(sgd, adam)". Throws c10::Error
  /// naming the text for an unknown distribution, a wrong number of arguments, low >= high,
  /// loguniform with low <= 0, q <= 0 and an empty choice.
  static Domain parse(const std::string& text);

  Kind kind() const { return kind_; }
  double low() const { return low_; }
  double high() const { return high_; }
  double q() const { return q_; }
  const std::vector<Value>& values() const { return values_; }
  /// choice and grid_search.
  bool categorical() const { return kind_ == Kind::kChoice || kind_ == Kind::kGrid; }
  bool log_scale() const { return kind_ == Kind::kLogUniform || kind_ == Kind::kQLogUniform; }

  /// A value drawn from the domain (grid_search draws one of its values).
  Value sample(std::mt19937_64& rng) const;
  /// For numeric domains: a float in the domain's range made a valid value (rounded to q, to an
  /// integer, clamped into the range).
  Value from_double(double x) const;
  /// The canonical text, which parse() reads back: "loguniform(0.001, 0.3)".
  std::string to_string() const;

 private:
  Domain(Kind kind, double low, double high, double q, std::vector<Value> values);
  Kind kind_;
  double low_ = 0, high_ = 0, q_ = 0;
  std::vector<Value> values_;
};

class SearchSpace {
 public:
  /// Adds a parameter; throws for an empty or repeated name, or one that is not a valid
  /// environment variable name (a command trial gets each value as one).
  void add(const std::string& name, Domain domain);
  /// "lr=loguniform(1e-3, 0.3)".
  void add(const std::string& assignment);
  const std::vector<std::pair<std::string, Domain>>& params() const { return params_; }
  bool empty() const { return params_.empty(); }
  /// One line per parameter, sorted by name: what a stored study is compared with.
  std::string canonical() const;
  /// The number of grid_search combinations (1 without grid_search).
  int64_t grid_size() const;

 private:
  std::vector<std::pair<std::string, Domain>> params_;
};

}  // namespace tune
}  // namespace paratrain
