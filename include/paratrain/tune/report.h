#pragma once

// `paratrain tune report`: one self-contained HTML file (inline SVG, no scripts, nothing fetched)
// drawn from storage alone, like Optuna's visualization module: the optimization history, each
// trial's intermediate values, each parameter against the metric, and the table of trials.

#include "paratrain/tune/storage.h"

#include <string>
#include <vector>

namespace paratrain {
namespace tune {

/// The report's HTML.
std::string html_report(const StudySpec& study, const std::vector<TrialRecord>& trials);

/// Writes the report of study `name` in the storage at `url` to `path` (atomically: a temporary
/// file renamed over it). Throws c10::Error for a study that does not exist.
void write_html_report(const std::string& url, const std::string& name, const std::string& path);

}  // namespace tune
}  // namespace paratrain
