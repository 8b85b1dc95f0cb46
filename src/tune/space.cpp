#include "paratrain/tune/space.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace paratrain {
namespace tune {
namespace {

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\n\r");
  if (b == std::string::npos) {
    return "";
  }
  size_t e = s.find_last_not_of(" \t\n\r");
  return s.substr(b, e - b + 1);
}

// Splits "a, 'b,c', [1, 2]" at the commas that are outside quotes and brackets.
std::vector<std::string> split_args(const std::string& text) {
  std::vector<std::string> out;
  std::string cur;
  int depth = 0;
  char quote = 0;
  for (char c : text) {
    if (quote) {
      quote = (c == quote) ? 0 : quote;
    } else if (c == '"' || c == '\'') {
      quote = c;
    } else if (c == '[' || c == '(') {
      ++depth;
    } else if (c == ']' || c == ')') {
      --depth;
    } else if (c == ',' && depth == 0) {
      out.push_back(trim(cur));
      cur.clear();
      continue;
    }
    cur += c;
  }
  if (!trim(cur).empty() || !out.empty()) {
    out.push_back(trim(cur));
  }
  return out;
}

bool parse_number(const std::string& s, double* out) {
  if (s.empty()) {
    return false;
  }
  char* end = nullptr;
  *out = std::strtod(s.c_str(), &end);
  return end == s.c_str() + s.size() && std::isfinite(*out);
}

bool parse_integer(const std::string& s, int64_t* out) {
  if (s.empty() || s.find_first_not_of("+-0123456789") != std::string::npos) {
    return false;
  }
  char* end = nullptr;
  errno = 0;
  *out = std::strtoll(s.c_str(), &end, 10);
  return errno == 0 && end == s.c_str() + s.size();
}

// A choice's value: an integer, a float, or a string (quotes optional).
Value parse_value(const std::string& word) {
  int64_t i = 0;
  double d = 0;
  if (parse_integer(word, &i)) {
    return i;
  }
  if (parse_number(word, &d)) {
    return d;
  }
  if (word.size() >= 2 && (word[0] == '"' || word[0] == '\'') && word.back() == word[0]) {
    return word.substr(1, word.size() - 2);
  }
  return word;
}

double number_arg(const std::string& text, const std::string& word, const char* what) {
  double d = 0;
  TORCH_CHECK(parse_number(word, &d), "search space: ", what, " of '", text, "' is not a number: '",
              word, "'");
  return d;
}

const char* kind_name(Domain::Kind kind) {
  switch (kind) {
    case Domain::Kind::kUniform:
      return "uniform";
    case Domain::Kind::kQUniform:
      return "quniform";
    case Domain::Kind::kLogUniform:
      return "loguniform";
    case Domain::Kind::kQLogUniform:
      return "qloguniform";
    case Domain::Kind::kRandInt:
      return "randint";
    case Domain::Kind::kChoice:
      return "choice";
    case Domain::Kind::kGrid:
      return "grid_search";
  }
  return "?";
}

// Quoted when a string would otherwise read back as a number or hold a separator.
std::string value_text(const Value& v) {
  if (const auto* s = std::get_if<std::string>(&v)) {
    double d = 0;
    if (parse_number(*s, &d) || s->find_first_of(",()[] '\"") != std::string::npos || s->empty()) {
      return "\"" + *s + "\"";
    }
  }
  return to_string(v);
}

}  // namespace

std::string to_string(const Value& value) {
  if (const auto* i = std::get_if<int64_t>(&value)) {
    return std::to_string(*i);
  }
  if (const auto* s = std::get_if<std::string>(&value)) {
    return *s;
  }
  const double d = std::get<double>(value);
  char buf[40];
  int precision = 1;
  for (; precision < 17; ++precision) {  // the shortest text that reads back
    std::snprintf(buf, sizeof(buf), "%.*g", precision, d);
    if (std::strtod(buf, nullptr) == d) {
      break;
    }
  }
  // ... with every integer digit written out (100, not 1e+02), up to 1e17
  const double digits = std::abs(d) >= 1 ? std::floor(std::log10(std::abs(d))) + 1 : 0;
  std::snprintf(buf, sizeof(buf), "%.*g",
                std::max(precision, static_cast<int>(std::min(digits, 17.0))), d);
  return buf;
}

double to_double(const Value& value) {
  if (const auto* i = std::get_if<int64_t>(&value)) {
    return static_cast<double>(*i);
  }
  if (const auto* d = std::get_if<double>(&value)) {
    return *d;
  }
  TORCH_CHECK(false, "search space: '", std::get<std::string>(value), "' is not a number");
}

std::string to_string(const Config& config) {
  std::string out;
  for (const auto& [name, value] : config) {
    out += (out.empty() ? "" : " ") + name + "=" + to_string(value);
  }
  return out;
}

Domain::Domain(Kind kind, double low, double high, double q, std::vector<Value> values)
    : kind_(kind), low_(low), high_(high), q_(q), values_(std::move(values)) {
  const std::string text = to_string();
  if (categorical()) {
    TORCH_CHECK(!values_.empty(), "search space: ", kind_name(kind_),
                "() needs at least one value; got an empty list");
    return;
  }
  TORCH_CHECK(std::isfinite(low_) && std::isfinite(high_) && low_ < high_, "search space: ", text,
              " needs low < high; got low ", low_, " and high ", high_);
  if (log_scale()) {
    TORCH_CHECK(low_ > 0, "search space: ", text, " needs low > 0 (a log scale); got low ", low_);
  }
  if (kind_ == Kind::kQUniform || kind_ == Kind::kQLogUniform) {
    TORCH_CHECK(std::isfinite(q_) && q_ > 0, "search space: ", text, " needs q > 0; got ", q_);
  }
}

Domain Domain::uniform(double low, double high) {
  return Domain(Kind::kUniform, low, high, 0, {});
}
Domain Domain::quniform(double low, double high, double q) {
  return Domain(Kind::kQUniform, low, high, q, {});
}
Domain Domain::loguniform(double low, double high) {
  return Domain(Kind::kLogUniform, low, high, 0, {});
}
Domain Domain::qloguniform(double low, double high, double q) {
  return Domain(Kind::kQLogUniform, low, high, q, {});
}
Domain Domain::randint(int64_t low, int64_t high) {
  return Domain(Kind::kRandInt, static_cast<double>(low), static_cast<double>(high), 0, {});
}
Domain Domain::choice(std::vector<Value> values) {
  return Domain(Kind::kChoice, 0, 0, 0, std::move(values));
}
Domain Domain::grid_search(std::vector<Value> values) {
  return Domain(Kind::kGrid, 0, 0, 0, std::move(values));
}

Domain Domain::parse(const std::string& raw) {
  const std::string text = trim(raw);
  const size_t open = text.find('(');
  TORCH_CHECK(open != std::string::npos && text.back() == ')', "search space: '", text,
              "' is not a distribution; write e.g. loguniform(1e-3, 0.3) or choice(32, 64)");
  const std::string name = trim(text.substr(0, open));
  std::vector<std::string> args = split_args(text.substr(open + 1, text.size() - open - 2));
  if ((name == "choice" || name == "grid_search") && args.size() == 1 && !args[0].empty() &&
      args[0].front() == '[' && args[0].back() == ']') {
    args = split_args(args[0].substr(1, args[0].size() - 2));  // choice([a, b]) as in Python
  }
  if (name == "choice" || name == "grid_search") {
    std::vector<Value> values;
    for (const auto& a : args) {
      values.push_back(parse_value(a));
    }
    return name == "choice" ? choice(std::move(values)) : grid_search(std::move(values));
  }
  const bool quantized = name == "quniform" || name == "qloguniform";
  if (name == "uniform" || name == "loguniform" || name == "randint" || quantized) {
    const size_t want = quantized ? 3 : 2;
    TORCH_CHECK(args.size() == want, "search space: ", name, " takes ", want,
                " arguments (low, high", quantized ? ", q" : "", "); got '", text, "'");
    const double low = number_arg(text, args[0], "low");
    const double high = number_arg(text, args[1], "high");
    if (name == "randint") {
      int64_t l = 0, h = 0;
      TORCH_CHECK(parse_integer(args[0], &l) && parse_integer(args[1], &h),
                  "search space: ", "randint takes integers; got '", text, "'");
      return randint(l, h);
    }
    if (name == "uniform") {
      return uniform(low, high);
    }
    if (name == "loguniform") {
      return loguniform(low, high);
    }
    const double q = number_arg(text, args[2], "q");
    return name == "quniform" ? quniform(low, high, q) : qloguniform(low, high, q);
  }
  TORCH_CHECK(false, "search space: unknown distribution '", name, "' in '", text,
              "'; use uniform, quniform, loguniform, qloguniform, randint, choice or "
              "grid_search");
}

Value Domain::from_double(double x) const {
  switch (kind_) {
    case Kind::kRandInt: {
      const double v = std::clamp(std::round(x), low_, high_ - 1);
      return static_cast<int64_t>(v);
    }
    case Kind::kQUniform:
    case Kind::kQLogUniform:
      // Ray Tune's Quantized: np.round(value / q) * q, which may leave [low, high] by q / 2
      return std::round(std::clamp(x, low_, high_) / q_) * q_;
    case Kind::kUniform:
    case Kind::kLogUniform:
      return std::clamp(x, low_, high_);
    default:
      TORCH_CHECK(false, "search space: ", to_string(), " is not numeric");
  }
}

Value Domain::sample(std::mt19937_64& rng) const {
  if (categorical()) {
    std::uniform_int_distribution<size_t> pick(0, values_.size() - 1);
    return values_[pick(rng)];
  }
  std::uniform_real_distribution<double> u(0.0, 1.0);
  if (kind_ == Kind::kRandInt) {
    std::uniform_int_distribution<int64_t> pick(static_cast<int64_t>(low_),
                                                static_cast<int64_t>(high_) - 1);
    return pick(rng);
  }
  double x = 0;
  if (log_scale()) {
    x = std::exp(std::log(low_) + u(rng) * (std::log(high_) - std::log(low_)));
  } else {
    x = low_ + u(rng) * (high_ - low_);
  }
  return from_double(x);
}

std::string Domain::to_string() const {
  std::ostringstream out;
  out << kind_name(kind_) << "(";
  if (categorical()) {
    for (size_t i = 0; i < values_.size(); ++i) {
      out << (i ? ", " : "") << value_text(values_[i]);
    }
  } else if (kind_ == Kind::kRandInt) {
    out << static_cast<int64_t>(low_) << ", " << static_cast<int64_t>(high_);
  } else {
    out << tune::to_string(Value(low_)) << ", " << tune::to_string(Value(high_));
    if (kind_ == Kind::kQUniform || kind_ == Kind::kQLogUniform) {
      out << ", " << tune::to_string(Value(q_));
    }
  }
  out << ")";
  return out.str();
}

void SearchSpace::add(const std::string& name, Domain domain) {
  TORCH_CHECK(!name.empty() && !std::isdigit(static_cast<unsigned char>(name[0])) &&
                  std::all_of(name.begin(), name.end(),
                              [](char c) {
                                return std::isalnum(static_cast<unsigned char>(c)) || c == '_' ||
                                       c == '-';
                              }),
              "search space: '", name,
              "' is not a valid parameter name (letters, digits, '_' and '-'; it becomes an "
              "environment variable and a flag)");
  for (const auto& p : params_) {
    TORCH_CHECK(p.first != name, "search space: parameter '", name, "' is given twice");
  }
  params_.emplace_back(name, std::move(domain));
}

void SearchSpace::add(const std::string& assignment) {
  const size_t eq = assignment.find('=');
  TORCH_CHECK(eq != std::string::npos, "search space: '", assignment,
              "' should be NAME=DISTRIBUTION, e.g. lr=loguniform(1e-3, 0.3)");
  add(trim(assignment.substr(0, eq)), Domain::parse(assignment.substr(eq + 1)));
}

std::string SearchSpace::canonical() const {
  std::vector<std::string> lines;
  for (const auto& [name, domain] : params_) {
    lines.push_back(name + "=" + domain.to_string());
  }
  std::sort(lines.begin(), lines.end());
  std::string out;
  for (const auto& l : lines) {
    out += l + "\n";
  }
  return out;
}

int64_t SearchSpace::grid_size() const {
  int64_t n = 1;
  for (const auto& p : params_) {
    if (p.second.kind() == Domain::Kind::kGrid) {
      n *= static_cast<int64_t>(p.second.values().size());
    }
  }
  return n;
}

}  // namespace tune
}  // namespace paratrain
