// A timeline of training in Chrome's trace event format (what Perfetto and chrome://tracing
// open): complete events ("ph": "X") with one process per rank and one track per thread.
//
//   paratrain::trace::Tracer tracer(rank);
//   paratrain::trace::set_current(&tracer);   // DDP's buckets and checkpoints report to it
//   { paratrain::trace::Span s("forward", "compute"); ... }
//   tracer.write("trace.rank-0.json");
//   paratrain::trace::merge({"trace.rank-0.json", "trace.rank-1.json"}, "trace.json");
//
// The Trainer does all of this for TrainerOptions::trace (`paratrain train --trace F.json`).
// Timestamps are CLOCK_MONOTONIC microseconds, one clock for every process of a machine.
#pragma once

#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace paratrain {
namespace trace {

using Clock = std::chrono::steady_clock;

class Tracer {
 public:
  /// Keeps the first `max_events` spans (about 100 bytes each) and counts the rest: a trace of a
  /// long run stays bounded; trace a short stretch (--steps) to see every step.
  explicit Tracer(int rank = 0, size_t max_events = 1000000)
      : rank_(rank), max_events_(max_events) {}
  /// Records one span; safe from any thread.
  void complete(const std::string& name,
                const char* category,
                Clock::time_point begin,
                Clock::time_point end);
  /// {"traceEvents": [...]} with a process name per rank; throws c10::Error if unwritable.
  void write(const std::string& path) const;
  size_t size() const;
  /// Spans left out once max_events were kept.
  size_t dropped() const;
  int rank() const { return rank_; }

 private:
  struct Event {
    std::string name;
    const char* category;
    int64_t ts_us;
    int64_t dur_us;
    int tid;
  };
  int rank_;
  size_t max_events_;
  size_t dropped_ = 0;
  int64_t first_drop_us_ = 0;
  mutable std::mutex mutex_;
  std::vector<Event> events_;
  std::vector<std::pair<std::thread::id, int>> threads_;  // small track numbers
};

/// The tracer that library code (DDP's buckets, checkpoint writes, Span) reports to; null: none.
Tracer* current();
void set_current(Tracer* tracer);

/// Records [construction, destruction) on the current tracer, if any.
class Span {
 public:
  Span(const char* name, const char* category);
  ~Span();
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  Tracer* tracer_;
  const char* name_;
  const char* category_;
  Clock::time_point begin_;
};

/// Joins the events of several trace files into one (each rank stays its own process).
void merge(const std::vector<std::string>& inputs, const std::string& output);

}  // namespace trace
}  // namespace paratrain
