#include "paratrain/util/trace.h"

#include "paratrain/util/atomic_file.h"

#include <c10/util/Exception.h>

#include <nlohmann/json.hpp>

#include <atomic>
#include <fstream>
#include <sstream>

namespace paratrain {
namespace trace {

namespace {

std::atomic<Tracer*> g_current{nullptr};

int64_t micros(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
}

}  // namespace

void Tracer::complete(const std::string& name,
                      const char* category,
                      Clock::time_point begin,
                      Clock::time_point end) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (events_.size() >= max_events_) {
    if (dropped_++ == 0) {
      first_drop_us_ = micros(begin);
    }
    return;
  }
  const auto me = std::this_thread::get_id();
  int tid = -1;
  for (const auto& t : threads_) {
    if (t.first == me) {
      tid = t.second;
    }
  }
  if (tid < 0) {
    tid = static_cast<int>(threads_.size());
    threads_.emplace_back(me, tid);
  }
  events_.push_back({name, category, micros(begin), micros(end) - micros(begin), tid});
}

size_t Tracer::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return events_.size();
}

size_t Tracer::dropped() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return dropped_;
}

void Tracer::write(const std::string& path) const {
  nlohmann::json events = nlohmann::json::array();
  events.push_back({{"name", "process_name"},
                    {"ph", "M"},
                    {"pid", rank_},
                    {"args", {{"name", "rank " + std::to_string(rank_)}}}});
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (dropped_ > 0) {  // said in the trace itself, where whoever reads it looks
      events.push_back(
          {{"name", "trace full: " + std::to_string(dropped_) +
                        " later spans left out (max_events " + std::to_string(max_events_) + ")"},
           {"ph", "i"},
           {"s", "p"},
           {"ts", first_drop_us_},
           {"pid", rank_},
           {"tid", 0}});
    }
    for (const auto& e : events_) {
      events.push_back({{"name", e.name},
                        {"cat", e.category},
                        {"ph", "X"},
                        {"ts", e.ts_us},
                        {"dur", e.dur_us},
                        {"pid", rank_},
                        {"tid", e.tid}});
    }
  }
  const std::string text =
      nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump() + "\n";
  write_file_atomic(path, text.data(), text.size());
}

Tracer* current() {
  return g_current.load();
}

void set_current(Tracer* tracer) {
  g_current.store(tracer);
}

Span::Span(const char* name, const char* category)
    : tracer_(current()), name_(name), category_(category) {
  if (tracer_ != nullptr) {
    begin_ = Clock::now();
  }
}

Span::~Span() {
  if (tracer_ != nullptr) {
    tracer_->complete(name_, category_, begin_, Clock::now());
  }
}

void merge(const std::vector<std::string>& inputs, const std::string& output) {
  nlohmann::json all = nlohmann::json::array();
  for (const auto& path : inputs) {
    std::ifstream in(path);
    TORCH_CHECK(in.good(), "trace: cannot read ", path);
    nlohmann::json part;
    try {
      in >> part;
    } catch (const nlohmann::json::exception& e) {
      TORCH_CHECK(false, "trace: ", path, " is not JSON: ", e.what());
    }
    for (auto& e : part.at("traceEvents")) {
      all.push_back(std::move(e));
    }
  }
  const std::string text =
      nlohmann::json{{"traceEvents", all}, {"displayTimeUnit", "ms"}}.dump() + "\n";
  write_file_atomic(output, text.data(), text.size());
}

}  // namespace trace
}  // namespace paratrain
