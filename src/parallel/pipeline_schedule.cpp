// Pipeline schedules: parsing a schedule's name, and the order of forwards and backwards each
// stage runs under GPipe and 1F1B.

#include "paratrain/parallel/pipeline.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>

namespace paratrain {
namespace pipeline {

Schedule parse_schedule(const std::string& name) {
  std::string lower;
  for (char c : name) {
    lower.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  }
  if (lower == "gpipe") {
    return Schedule::kGPipe;
  }
  if (lower == "1f1b") {
    return Schedule::k1F1B;
  }
  TORCH_CHECK(false, "pipeline: unknown schedule '", name, "': choose gpipe or 1f1b");
}

std::string to_string(Schedule schedule) {
  return schedule == Schedule::kGPipe ? "gpipe" : "1f1b";
}

std::vector<Action> actions(Schedule schedule, int64_t stage, int64_t stages, int64_t chunks) {
  TORCH_CHECK(stages >= 1 && stage >= 0 && stage < stages, "pipeline: stage ", stage, " of ",
              stages, " does not exist");
  TORCH_CHECK(chunks >= 1, "pipeline: chunks must be >= 1, got ", chunks);
  using K = Action::Kind;
  std::vector<Action> out;
  if (schedule == Schedule::kGPipe) {
    for (int64_t i = 0; i < chunks; ++i) {
      out.push_back({K::kForward, i});
    }
    for (int64_t i = 0; i < chunks; ++i) {
      out.push_back({K::kBackward, i});
    }
    return out;
  }
  // 1F1B (PipeDream-Flush): the later the stage, the fewer forwards run ahead of the first
  // backward, which bounds the activations held on stage s by p - s.
  const int64_t warmup = std::min(stages - stage - 1, chunks);
  int64_t f = 0;
  int64_t b = 0;
  for (; f < warmup; ++f) {
    out.push_back({K::kForward, f});
  }
  while (f < chunks) {
    out.push_back({K::kForward, f++});
    out.push_back({K::kBackward, b++});
  }
  while (b < chunks) {
    out.push_back({K::kBackward, b++});
  }
  return out;
}

}  // namespace pipeline
}  // namespace paratrain
