// The tuner's output: its events as plain lines or JSON rows, the live table, and the summary of
// the study that tune() returns.

#include "tuner_output.h"

#include "trial_value.h"

#include <unistd.h>

#include <cmath>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <utility>

namespace paratrain {
namespace tune {
namespace detail {

std::string format_value(double v) {
  std::ostringstream out;
  out << std::setprecision(6) << v;
  return out.str();
}

TuneResult summarize(const std::map<int64_t, TrialRecord>& trials,
                     int64_t started,
                     const std::string& mode,
                     const std::string& scope) {
  TuneResult out;
  out.started = started;
  for (const auto& [n, t] : trials) {
    TrialSummary s;
    s.number = n;
    s.state = t.state;
    s.config = t.config;
    s.iterations = t.results.empty() ? 0 : t.results.back().first;
    s.value = scoped_value(t, scope, mode);
    s.log_path = t.log_path;
    s.exit_status = t.exit_status;
    s.error = t.error;
    if (!std::isnan(s.value) &&
        (!out.best || loss_of(s.value, mode) < loss_of(out.best->value, mode))) {
      out.best = s;
    }
    out.trials.push_back(std::move(s));
  }
  return out;
}

TunerOutput::TunerOutput(std::string output, std::string metric)
    : output_(std::move(output)), metric_(std::move(metric)) {}

void TunerOutput::say(const std::string& plain, const nlohmann::ordered_json& row) const {
  if (output_ == "plain") {
    std::cout << plain << std::endl;
  } else if (output_ == "json") {
    std::cout << row.dump() << std::endl;
  }
}

bool TunerOutput::table_due(bool force) {
  if (output_ != "table" ||
      (!force && std::chrono::steady_clock::now() - last_table_ < std::chrono::seconds(2))) {
    return false;
  }
  last_table_ = std::chrono::steady_clock::now();
  return true;
}

void TunerOutput::print_table(const TuneResult& s, const SearchSpace& space) const {
  std::ostringstream out;
  if (::isatty(1)) {
    out << "\033[2J\033[H";  // redraw in place, as a live table
  }
  std::map<std::string, int> counts;
  for (const auto& t : s.trials) {
    counts[to_string(t.state)]++;
  }
  out << "== Status ==";
  for (const auto& [state, n] : counts) {
    out << " " << state << " " << n;
  }
  if (s.best) {
    out << " | best: trial " << s.best->number << " " << metric_ << " "
        << format_value(s.best->value);
  }
  out << "\n" << std::left << std::setw(8) << "trial" << std::setw(10) << "state";
  for (const auto& p : space.params()) {
    out << std::setw(14) << p.first;
  }
  out << std::setw(6) << "iter" << metric_ << "\n";
  for (const auto& t : s.trials) {
    out << std::setw(8) << t.number << std::setw(10) << to_string(t.state);
    for (const auto& p : space.params()) {
      const auto v = t.config.find(p.first);
      out << std::setw(14) << (v == t.config.end() ? "" : to_string(v->second).substr(0, 13));
    }
    out << std::setw(6) << t.iterations << (std::isnan(t.value) ? "" : format_value(t.value))
        << "\n";
  }
  std::cout << out.str() << std::flush;
}

}  // namespace detail
}  // namespace tune
}  // namespace paratrain
