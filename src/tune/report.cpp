// The HTML report of report.h. SVG is written by hand: it is a handful of lines and dots, and a
// charting library would mean scripts or network access in the file.

#include "paratrain/tune/report.h"

#include <c10/util/Exception.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>

namespace paratrain {
namespace tune {
namespace {

constexpr int kWidth = 560, kHeight = 320, kLeft = 64, kRight = 16, kTop = 16, kBottom = 40;
const char* kPalette[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                          "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.4g", v);
  return buf;
}

// One axis: a data range mapped onto pixels, linear or logarithmic.
struct PlotAxis {
  double lo = 0, hi = 1;
  bool log = false;
  double pixel_lo = 0, pixel_hi = 1;

  static PlotAxis of(std::vector<double> v, bool log, double pixel_lo, double pixel_hi) {
    PlotAxis a;
    a.log = log;
    a.pixel_lo = pixel_lo;
    a.pixel_hi = pixel_hi;
    v.erase(std::remove_if(v.begin(), v.end(),
                           [&](double x) { return !std::isfinite(x) || (log && x <= 0); }),
            v.end());
    if (v.empty()) {
      return a;
    }
    a.lo = *std::min_element(v.begin(), v.end());
    a.hi = *std::max_element(v.begin(), v.end());
    if (log) {
      a.lo = std::log10(a.lo);
      a.hi = std::log10(a.hi);
    }
    if (a.hi - a.lo < 1e-12) {
      a.lo -= 0.5;
      a.hi += 0.5;
    }
    const double pad = (a.hi - a.lo) * 0.05;
    a.lo -= pad;
    a.hi += pad;
    return a;
  }
  double operator()(double x) const {
    const double t = ((log ? std::log10(x) : x) - lo) / (hi - lo);
    return pixel_lo + t * (pixel_hi - pixel_lo);
  }
  double value_at(double t) const {  // t in [0, 1] along the axis
    const double x = lo + t * (hi - lo);
    return log ? std::pow(10, x) : x;
  }
};

class Plot {
 public:
  Plot(const std::string& title,
       const std::string& xlabel,
       const std::string& ylabel,
       const std::vector<double>& xs,
       const std::vector<double>& ys,
       bool xlog = false,
       bool ylog = false)
      : x_(PlotAxis::of(xs, xlog, kLeft, kWidth - kRight)),
        y_(PlotAxis::of(ys, ylog, kHeight - kBottom, kTop)) {
    out_ << "<figure><figcaption>" << escape(title) << "</figcaption>"
         << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << kWidth << "\" height=\""
         << kHeight << "\" viewBox=\"0 0 " << kWidth << " " << kHeight << "\">"
         << "<rect x=\"" << kLeft << "\" y=\"" << kTop << "\" width=\"" << kWidth - kLeft - kRight
         << "\" height=\"" << kHeight - kTop - kBottom << "\" fill=\"#fafafa\" stroke=\"#999\"/>";
    for (int i = 0; i <= 4; ++i) {  // ticks
      const double t = i / 4.0;
      const double px = kLeft + t * (kWidth - kLeft - kRight);
      const double py = kHeight - kBottom - t * (kHeight - kTop - kBottom);
      out_ << "<text x=\"" << px << "\" y=\"" << kHeight - kBottom + 14
           << "\" font-size=\"10\" text-anchor=\"middle\">" << num(x_.value_at(t)) << "</text>"
           << "<text x=\"" << kLeft - 4 << "\" y=\"" << py + 3
           << "\" font-size=\"10\" text-anchor=\"end\">" << num(y_.value_at(t)) << "</text>";
    }
    out_ << "<text x=\"" << (kLeft + kWidth - kRight) / 2 << "\" y=\"" << kHeight - 6
         << "\" font-size=\"12\" text-anchor=\"middle\">" << escape(xlabel) << "</text>"
         << "<text x=\"12\" y=\"" << (kTop + kHeight - kBottom) / 2
         << "\" font-size=\"12\" text-anchor=\"middle\" transform=\"rotate(-90 12 "
         << (kTop + kHeight - kBottom) / 2 << ")\">" << escape(ylabel) << "</text>";
  }
  void dot(double x, double y, const char* color, const std::string& tip) {
    if (!std::isfinite(x) || !std::isfinite(y) || (x_.log && x <= 0) || (y_.log && y <= 0)) {
      return;
    }
    out_ << "<circle cx=\"" << x_(x) << "\" cy=\"" << y_(y) << "\" r=\"4\" fill=\"" << color
         << "\"><title>" << escape(tip) << "</title></circle>";
  }
  void line(const std::vector<std::pair<double, double>>& pts, const char* color, double w) {
    std::ostringstream d;
    for (const auto& [x, y] : pts) {
      if (std::isfinite(x) && std::isfinite(y) && !(y_.log && y <= 0)) {
        d << (d.tellp() == 0 ? "M" : " L") << x_(x) << " " << y_(y);
      }
    }
    if (d.tellp() > 0) {
      out_ << "<path d=\"" << d.str() << "\" fill=\"none\" stroke=\"" << color
           << "\" stroke-width=\"" << w << "\"/>";
    }
  }
  std::string done() {
    out_ << "</svg></figure>\n";
    return out_.str();
  }

 private:
  PlotAxis x_, y_;
  std::ostringstream out_;
};

double final_value(const TrialRecord& t) {
  return t.results.empty() ? std::nan("") : t.results.back().second;
}

std::string history(const StudySpec& s, const std::vector<TrialRecord>& trials) {
  std::vector<double> xs, ys;
  for (const auto& t : trials) {
    xs.push_back(static_cast<double>(t.number));
    ys.push_back(final_value(t));
  }
  Plot p("Optimization history", "trial", s.metric, xs, ys);
  std::vector<std::pair<double, double>> best;
  double b = std::nan("");
  for (const auto& t : trials) {
    const double v = final_value(t);
    if (std::isfinite(v) && (std::isnan(b) || (s.mode == "max" ? v > b : v < b))) {
      b = v;
    }
    if (!std::isnan(b)) {
      best.emplace_back(static_cast<double>(t.number), b);
    }
    p.dot(static_cast<double>(t.number), v, kPalette[0],
          "trial " + std::to_string(t.number) + ": " + num(v));
  }
  p.line(best, kPalette[3], 2);
  return p.done();
}

std::string curves(const StudySpec& s, const std::vector<TrialRecord>& trials) {
  std::vector<double> xs, ys;
  for (const auto& t : trials) {
    for (const auto& [it, v] : t.results) {
      xs.push_back(static_cast<double>(it));
      ys.push_back(v);
    }
  }
  Plot p("Intermediate values", "iteration", s.metric, xs, ys);
  for (const auto& t : trials) {
    std::vector<std::pair<double, double>> pts;
    for (const auto& [it, v] : t.results) {
      pts.emplace_back(static_cast<double>(it), v);
    }
    const char* color = kPalette[t.number % 10];
    p.line(pts, color, 1.5);
    if (!pts.empty()) {
      p.dot(pts.back().first, pts.back().second, color,
            "trial " + std::to_string(t.number) + " (" + to_string(t.state) + ")");
    }
  }
  return p.done();
}

std::string scatters(const StudySpec& s, const std::vector<TrialRecord>& trials) {
  SearchSpace space;
  std::istringstream lines(s.space);
  for (std::string line; std::getline(lines, line);) {
    if (!line.empty()) {
      space.add(line);
    }
  }
  std::string out;
  for (const auto& [name, domain] : space.params()) {
    std::vector<double> xs, ys;
    std::vector<std::string> labels;  // categorical values are placed at their index
    for (const auto& t : trials) {
      const auto v = t.config.find(name);
      if (v == t.config.end()) {
        continue;
      }
      double x = 0;
      if (domain.categorical()) {
        const auto& values = domain.values();
        x = static_cast<double>(std::find(values.begin(), values.end(), v->second) -
                                values.begin());
      } else {
        x = to_double(v->second);
      }
      xs.push_back(x);
      ys.push_back(final_value(t));
    }
    std::string title = name + " = " + domain.to_string();
    if (domain.categorical()) {
      title += " (by index)";
    }
    Plot p(title, name, s.metric, xs, ys, domain.log_scale());
    for (size_t i = 0; i < xs.size(); ++i) {
      p.dot(xs[i], ys[i], kPalette[0], name + " " + num(xs[i]) + ": " + num(ys[i]));
    }
    out += p.done();
  }
  return out;
}

std::string table(const StudySpec& s, const std::vector<TrialRecord>& trials) {
  std::ostringstream out;
  out << "<table><tr><th>trial</th><th>state</th><th>parameters</th><th>iterations</th><th>"
      << escape(s.metric)
      << " (last)</th><th>retries</th><th>exit status</th><th>error</th><th>log</th></tr>\n";
  for (const auto& t : trials) {
    out << "<tr><td>" << t.number << "</td><td>" << to_string(t.state) << "</td><td>"
        << escape(to_string(t.config)) << "</td><td>"
        << (t.results.empty() ? 0 : t.results.back().first) << "</td><td>" << num(final_value(t))
        << "</td><td>" << t.attempts << "</td><td>" << t.exit_status << "</td><td>"
        << escape(t.error) << "</td><td>" << escape(t.log_path) << "</td></tr>\n";
  }
  out << "</table>\n";
  return out.str();
}

// ---- population-based training ----

// A stretch of a trial's history: iterations [first, last] trained as trial `trial` with
// `config`.
struct Segment {
  int64_t trial = 0, first = 1, last = 0;
  Config config;
};

// What trial `number` followed up to iteration `upto`, from exploits made before `before`: the
// source's history up to its checkpoint, then the trial's own from there (with its new config).
std::vector<Segment> lineage(int64_t number,
                             int64_t upto,
                             double before,
                             const std::map<int64_t, Config>& configs,
                             const std::vector<ExploitRecord>& exploits) {
  const ExploitRecord* last = nullptr;
  const ExploitRecord* first = nullptr;
  for (const auto& e : exploits) {
    if (e.trial == number) {
      first = first ? first : &e;
      last = e.time < before ? &e : last;
    }
  }
  if (last == nullptr) {  // its own start: the config it had before any exploit
    const auto c = configs.find(number);
    return {{number, 1, upto,
             first                ? first->old_config
             : c == configs.end() ? Config{}
                                  : c->second}};
  }
  std::vector<Segment> out =
      lineage(last->source, last->source_iteration, last->time, configs, exploits);
  if (upto > last->source_iteration) {  // none yet: exploited, not trained since
    out.push_back({number, last->source_iteration + 1, upto, last->new_config});
  }
  return out;
}

std::string describe(const std::vector<Segment>& segments) {
  std::string out;
  for (const auto& s : segments) {
    out += (out.empty() ? "" : " &rarr; ") + std::string("trial ") + std::to_string(s.trial) +
           " (" + std::to_string(s.first) + "&ndash;" + std::to_string(s.last) + ": " +
           escape(to_string(s.config)) + ")";
  }
  return out;
}

// The mutated parameters: those some exploit changed.
std::vector<std::string> mutated(const std::vector<ExploitRecord>& exploits) {
  std::vector<std::string> names;
  for (const auto& e : exploits) {
    for (const auto& [name, v] : e.new_config) {
      const auto old = e.old_config.find(name);
      if ((old == e.old_config.end() || !(old->second == v)) &&
          std::find(names.begin(), names.end(), name) == names.end()) {
        names.push_back(name);
      }
    }
  }
  return names;
}

// One plot per numeric mutated parameter: the value each surviving trial trained with, by
// iteration (a step line), following its lineage.
std::string schedules(const std::map<int64_t, std::vector<Segment>>& lines,
                      const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& name : names) {
    std::vector<std::pair<int64_t, std::vector<std::pair<double, double>>>> series;
    std::vector<double> xs, ys;
    for (const auto& [n, segments] : lines) {
      std::vector<std::pair<double, double>> pts;
      for (const auto& seg : segments) {
        const auto v = seg.config.find(name);
        if (v == seg.config.end() || std::holds_alternative<std::string>(v->second)) {
          continue;
        }
        const double y = to_double(v->second);
        pts.emplace_back(static_cast<double>(seg.first) - 1, y);
        pts.emplace_back(static_cast<double>(seg.last), y);
        xs.insert(xs.end(), {static_cast<double>(seg.first) - 1, static_cast<double>(seg.last)});
        ys.push_back(y);
      }
      series.emplace_back(n, pts);
    }
    if (ys.empty()) {
      continue;
    }
    const bool log = *std::min_element(ys.begin(), ys.end()) > 0;
    Plot p(name + " schedule of the surviving trials", "iteration", name, xs, ys, false, log);
    for (const auto& [n, pts] : series) {
      p.line(pts, kPalette[n % 10], 2);
      if (!pts.empty()) {
        p.dot(pts.back().first, pts.back().second, kPalette[n % 10],
              "trial " + std::to_string(n) + ": " + num(pts.back().second));
      }
    }
    out += p.done();
  }
  return out;
}

std::string pbt_section(const std::vector<TrialRecord>& trials,
                        const std::vector<ExploitRecord>& exploits) {
  if (exploits.empty()) {
    return "";
  }
  std::map<int64_t, Config> configs;
  std::map<int64_t, std::vector<Segment>> lines;  // the surviving (not stopped or failed) trials
  for (const auto& t : trials) {
    configs[t.number] = t.config;
  }
  for (const auto& t : trials) {
    if (t.state != TrialState::kStopped && t.state != TrialState::kFailed) {
      const int64_t upto = t.results.empty() ? 0 : t.results.back().first;
      lines[t.number] = lineage(t.number, upto, HUGE_VAL, configs, exploits);
    }
  }
  std::ostringstream out;
  out << "<h2>Population-based training</h2>\n<h3>Lineage</h3>\n<ul>\n";
  for (const auto& [n, segments] : lines) {
    out << "<li>trial " << n << ": " << describe(segments) << "</li>\n";
  }
  out << "</ul>\n" << schedules(lines, mutated(exploits)) << "<h3>Exploits</h3>\n<ul>\n";
  for (const auto& e : exploits) {
    out << "<li>iteration " << e.iteration << ": trial " << e.trial << " exploits trial "
        << e.source << " (its checkpoint at iteration " << e.source_iteration
        << "): " << escape(to_string(e.old_config)) << " &rarr; " << escape(to_string(e.new_config))
        << "</li>\n";
  }
  out << "</ul>\n";
  return out.str();
}

}  // namespace

std::string html_report_body(const StudySpec& study,
                             const std::vector<TrialRecord>& trials,
                             const std::vector<ExploitRecord>& exploits) {
  std::ostringstream out;
  out << "<h1>Study " << escape(study.name) << "</h1><p>" << trials.size() << " trials; "
      << escape(study.mode == "max" ? "maximize " : "minimize ") << escape(study.metric)
      << "</p>\n<pre>" << escape(study.space) << "</pre>\n"
      << history(study, trials) << curves(study, trials) << pbt_section(trials, exploits)
      << "<h2>Parameters</h2>\n"
      << scatters(study, trials) << "<h2>Trials</h2>\n"
      << table(study, trials);
  return out.str();
}

std::string html_page(const std::string& title, const std::string& body, const std::string& head) {
  std::ostringstream out;
  out << "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>" << escape(title)
      << "</title><style>"
      << "body{font-family:sans-serif;margin:24px}figure{display:inline-block;margin:8px}"
      << "figcaption{font-weight:bold;margin-bottom:4px}table{border-collapse:collapse}"
      << "td,th{border:1px solid #ccc;padding:2px 6px;font-size:12px}</style>" << head
      << "</head><body>\n"
      << body << "</body></html>\n";
  return out.str();
}

std::string html_escape(const std::string& text) {
  return escape(text);
}

std::string html_report(const StudySpec& study,
                        const std::vector<TrialRecord>& trials,
                        const std::vector<ExploitRecord>& exploits) {
  return html_page("paratrain tune: " + study.name, html_report_body(study, trials, exploits), "");
}

void write_html_report(const std::string& url, const std::string& name, const std::string& path) {
  auto storage = open_storage(url, true);
  const StudySpec spec = storage->load_study(name);
  const std::string html = html_report(spec, storage->load_trials(), storage->load_exploits());
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  {
    std::ofstream f(tmp, std::ios::binary);
    f << html;
    f.close();
    TORCH_CHECK(f, "tune report: cannot write ", tmp, ": ", std::strerror(errno));
  }
  TORCH_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "tune report: cannot rename ", tmp,
              " to ", path, ": ", std::strerror(errno));
}

}  // namespace tune
}  // namespace paratrain
