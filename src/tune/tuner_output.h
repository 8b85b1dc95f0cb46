#pragma once

// Internal: what the tuner prints on stdout (TunerOptions::output): a line or a JSON row per
// event, or a live table; and the study's summary, which the table shows and tune() returns.

#include "paratrain/tune/space.h"
#include "paratrain/tune/storage.h"
#include "paratrain/tune/tuner.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <map>
#include <string>

namespace paratrain {
namespace tune {
namespace detail {

/// A metric value as the tuner prints it (6 significant digits).
std::string format_value(double v);

/// The study as tune() returns it: the trials known here (`started` of them started by this
/// tuner), each judged by mode and scope, and the best of them.
TuneResult summarize(const std::map<int64_t, TrialRecord>& trials,
                     int64_t started,
                     const std::string& mode,
                     const std::string& scope);

class TunerOutput {
 public:
  /// `output`: "plain", "json", "table" or "none"; `metric`: the one the table shows.
  TunerOutput(std::string output, std::string metric);

  /// An event: the line `plain` for plain output, `row` for json output, nothing otherwise.
  void say(const std::string& plain, const nlohmann::ordered_json& row) const;
  /// Whether the table is due: table output, and `force` or 2 s since the last one (which a
  /// true answer counts from now).
  bool table_due(bool force);
  /// The table of `summary`'s trials, a column per parameter of `space`.
  void print_table(const TuneResult& summary, const SearchSpace& space) const;

 private:
  std::string output_;
  std::string metric_;
  std::chrono::steady_clock::time_point last_table_;
};

}  // namespace detail
}  // namespace tune
}  // namespace paratrain
