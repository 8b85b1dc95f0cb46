#pragma once

// `paratrain tune report`: one self-contained HTML file (inline SVG, no scripts, nothing fetched)
// drawn from storage alone, like Optuna's visualization module: the optimization history, each
// trial's intermediate values, each parameter against the metric, and the table of trials; for
// population-based training, each surviving trial's lineage, the schedule of each mutated
// parameter it followed, and the exploits. Every string from the study is HTML-escaped.

#include "paratrain/tune/storage.h"

#include <string>
#include <vector>

namespace paratrain {
namespace tune {

/// The report's HTML.
std::string html_report(const StudySpec& study,
                        const std::vector<TrialRecord>& trials,
                        const std::vector<ExploitRecord>& exploits = {});

/// The report without its page (what `paratrain tune serve` refreshes in place).
std::string html_report_body(const StudySpec& study,
                             const std::vector<TrialRecord>& trials,
                             const std::vector<ExploitRecord>& exploits = {});

/// A page around `body`, with the report's style and `head` (trusted HTML) in its head.
std::string html_page(const std::string& title, const std::string& body, const std::string& head);

/// `text` with &, <, >, " and ' escaped for HTML text and attribute values.
std::string html_escape(const std::string& text);

/// Writes the report of study `name` in the storage at `url` to `path` (atomically: a temporary
/// file renamed over it). Throws c10::Error for a study that does not exist.
void write_html_report(const std::string& url, const std::string& name, const std::string& path);

}  // namespace tune
}  // namespace paratrain
