#pragma once

// Internal: numbers the tuner's parts share.

#include <limits>

namespace paratrain {
namespace tune {

/// A loss worse than any (a trial that ended without one, a NaN result).
inline constexpr double kInf = std::numeric_limits<double>::infinity();

}  // namespace tune
}  // namespace paratrain
