#pragma once

// Internal: how the tuner judges a trial's results by TunerOptions::mode and scope; shared by the
// state machine (tuner.cpp) and the summary (tuner_output.cpp).

#include "limits.h"

#include "paratrain/tune/storage.h"

#include <cmath>
#include <string>

namespace paratrain {
namespace tune {
namespace detail {

/// A metric value as a loss, lower better: negated for mode "max"; NaN ranks last (kInf).
inline double loss_of(double value, const std::string& mode) {
  const double l = mode == "max" ? -value : value;
  return std::isnan(l) ? kInf : l;
}

/// The value a trial is judged by: its last result (scope "last") or its best by mode; NaN when
/// it reported none.
inline double scoped_value(const TrialRecord& t,
                           const std::string& scope,
                           const std::string& mode) {
  if (t.results.empty()) {
    return std::nan("");
  }
  if (scope == "last") {
    return t.results.back().second;
  }
  double best = t.results.front().second;
  for (const auto& r : t.results) {
    if (loss_of(r.second, mode) < loss_of(best, mode)) {
      best = r.second;
    }
  }
  return best;
}

}  // namespace detail
}  // namespace tune
}  // namespace paratrain
