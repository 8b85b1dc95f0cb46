#pragma once

// Where a study lives: its definition, its trials, their parameters, states, intermediate and
// final values, timestamps and log paths. Every change is one transaction, so a tuner killed at
// any moment leaves a consistent study that the next tuner on the same storage continues.
//
//   sqlite:///study.db   (or a plain path) an SQLite file, created on first use: relative after
//                        "sqlite:///", absolute with a fourth slash, as SQLAlchemy and Optuna read
//                        them
//   postgresql://USER@HOST:PORT/DB   a PostgreSQL database (libpq's URLs, ?host=/socket/dir for a
//                        Unix socket), for tuners on several machines sharing one study

#include "paratrain/tune/space.h"

#include <memory>
#include <string>
#include <vector>

namespace paratrain {
namespace tune {

/// What defines a study; a second tuner on the same study must bring the same definition.
struct StudySpec {
  std::string name;
  std::string space;  ///< SearchSpace::canonical()
  std::string metric;
  std::string mode;  ///< "min" or "max"
};

enum class TrialState { kPending, kRunning, kPaused, kComplete, kStopped, kFailed };

const char* to_string(TrialState state);
/// Complete, stopped or failed.
bool finished(TrialState state);

struct TrialRecord {
  int64_t number = 0;
  TrialState state = TrialState::kPending;
  Config config;
  int attempts = 0;     ///< times it was started after failing (retries)
  int exit_status = 0;  ///< the last run's exit code, or 128 + signal
  std::string error;    ///< why it failed, one line
  std::string log_path;
  double started = 0;  ///< Unix time of the first start, 0 before
  double ended = 0;    ///< Unix time it finished, 0 before
  /// (iteration, metric value) in report order; the metric as reported (not negated).
  std::vector<std::pair<int64_t, double>> results;
  /// The tuner running it ("host:pid"), and when it last said so (Unix time).
  std::string worker;
  double heartbeat = 0;
};

/// One exploit step of population-based training: `trial` continued from `source`'s checkpoint
/// with a perturbed config.
struct ExploitRecord {
  int64_t trial = 0;
  int64_t source = 0;
  int64_t iteration = 0;         ///< the trial's last iteration before it
  int64_t source_iteration = 0;  ///< the source's iteration (its checkpoint's)
  Config old_config, new_config;
  double time = 0;  ///< Unix time
};

class Storage {
 public:
  virtual ~Storage() = default;
  /// Opens the study, creating it when new. Throws c10::Error when a study of that name exists
  /// with a different space, metric or mode (its trials are left as they are).
  virtual void open_study(const StudySpec& spec) = 0;
  /// Opens an existing study as it is stored; throws c10::Error naming the studies there when
  /// there is none of that name.
  virtual StudySpec load_study(const std::string& name) = 0;
  virtual std::vector<TrialRecord> load_trials() = 0;
  /// Adds trial `record.number`; throws if that number exists.
  virtual void add_trial(const TrialRecord& record) = 0;
  /// In one transaction: the study's next trial number, added as RUNNING for `worker` with an
  /// empty config; -1 when the study already has `limit` trials. Tuners sharing a study never
  /// get the same number.
  virtual int64_t reserve_trial(int64_t limit, const std::string& worker) = 0;
  virtual void set_config(int64_t number, const Config& config) = 0;
  /// PENDING -> RUNNING for `worker`; false when another tuner claimed it first.
  virtual bool claim_trial(int64_t number, const std::string& worker) = 0;
  /// RUNNING for `worker` with heartbeat `seen_heartbeat` -> PENDING with one more attempt (its
  /// worker died); false when that worker no longer holds it or sent a heartbeat since.
  virtual bool release_trial(int64_t number,
                             const std::string& worker,
                             double seen_heartbeat,
                             bool count_attempt = true) = 0;
  /// Marks every trial `worker` runs as alive now; returns their numbers (a trial missing from
  /// them was taken over by another tuner).
  virtual std::vector<int64_t> heartbeat(const std::string& worker) = 0;
  /// Writes state, attempts, exit status, error, log path, times and worker (not the results
  /// nor the config), only if the stored trial is in state `from` and, when `from_worker` is
  /// not empty, held by that worker. False when it was not (another tuner moved it first).
  virtual bool update_trial(const TrialRecord& record,
                            TrialState from,
                            const std::string& from_worker) = 0;
  /// One reported row; `row_json` is the trial's whole JSON line. Stored only while `worker`
  /// holds the trial (RUNNING); false when it does not any more.
  virtual bool add_result(int64_t number,
                          int64_t iteration,
                          double value,
                          const std::string& row_json,
                          const std::string& worker) = 0;
  /// Records an exploit step of the open study and sets the trial's config to its new one, in
  /// one transaction.
  virtual void add_exploit(const ExploitRecord& exploit) = 0;
  /// The open study's exploit steps, in the order they happened.
  virtual std::vector<ExploitRecord> load_exploits() = 0;
  /// Every study's definition, by name.
  virtual std::vector<StudySpec> list_studies() = 0;
  /// The URL it was opened with.
  virtual std::string url() const = 0;
};

/// Opens storage from a URL. Throws c10::Error with one line for a malformed URL, an unknown
/// scheme and a database that cannot be opened (naming the path and the reason). `read_only`:
/// nothing is created or changed (an SQLite file must exist; a PostgreSQL connection is read-only),
/// and every method that writes throws.
std::unique_ptr<Storage> open_storage(const std::string& url, bool read_only = false);

}  // namespace tune
}  // namespace paratrain
