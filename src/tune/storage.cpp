#include "paratrain/tune/storage.h"

#include <c10/util/Exception.h>
#include <sqlite3.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <limits>

namespace paratrain {
namespace tune {

const char* to_string(TrialState state) {
  switch (state) {
    case TrialState::kPending:
      return "PENDING";
    case TrialState::kRunning:
      return "RUNNING";
    case TrialState::kPaused:
      return "PAUSED";
    case TrialState::kComplete:
      return "COMPLETE";
    case TrialState::kStopped:
      return "STOPPED";
    case TrialState::kFailed:
      return "FAILED";
  }
  return "?";
}

bool finished(TrialState s) {
  return s == TrialState::kComplete || s == TrialState::kStopped || s == TrialState::kFailed;
}

namespace {

TrialState state_from(const std::string& s) {
  for (auto st : {TrialState::kPending, TrialState::kRunning, TrialState::kPaused,
                  TrialState::kComplete, TrialState::kStopped, TrialState::kFailed}) {
    if (s == to_string(st)) {
      return st;
    }
  }
  TORCH_CHECK(false, "tune storage: unknown trial state '", s, "'");
}

std::string config_json(const Config& c) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [name, v] : c) {
    std::visit([&, n = name](const auto& x) { j[n] = x; }, v);
  }
  return j.dump();
}

Config config_from(const std::string& text) {
  Config c;
  const nlohmann::json j = nlohmann::json::parse(text);
  for (const auto& [name, v] : j.items()) {
    if (v.is_number_integer()) {
      c[name] = v.get<int64_t>();
    } else if (v.is_number()) {
      c[name] = v.get<double>();
    } else {
      c[name] = v.get<std::string>();
    }
  }
  return c;
}

const char* kSchema = R"sql(
CREATE TABLE IF NOT EXISTS studies (
  name TEXT PRIMARY KEY, space TEXT NOT NULL, metric TEXT NOT NULL, mode TEXT NOT NULL,
  created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS trials (
  study TEXT NOT NULL REFERENCES studies(name), number INTEGER NOT NULL, state TEXT NOT NULL,
  params TEXT NOT NULL, attempts INTEGER NOT NULL, exit_status INTEGER NOT NULL,
  error TEXT NOT NULL, log_path TEXT NOT NULL, started REAL NOT NULL, ended REAL NOT NULL,
  PRIMARY KEY (study, number));
CREATE TABLE IF NOT EXISTS results (
  study TEXT NOT NULL, number INTEGER NOT NULL, seq INTEGER NOT NULL, iteration INTEGER NOT NULL,
  value REAL, row TEXT NOT NULL, time REAL NOT NULL, PRIMARY KEY (study, number, seq));
)sql";

double now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// A prepared statement that finalizes itself.
class Stmt {
 public:
  Stmt(sqlite3* db, const char* sql) : db_(db) {
    const int rc = sqlite3_prepare_v2(db, sql, -1, &s_, nullptr);
    TORCH_CHECK(rc == SQLITE_OK, "tune storage: ", sqlite3_errmsg(db), " in: ", sql);
  }
  ~Stmt() { sqlite3_finalize(s_); }
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;
  Stmt& bind(int i, const std::string& v) {
    sqlite3_bind_text(s_, i, v.c_str(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
    return *this;
  }
  Stmt& bind(int i, int64_t v) {
    sqlite3_bind_int64(s_, i, v);
    return *this;
  }
  Stmt& bind(int i, double v) {
    if (std::isnan(v)) {
      sqlite3_bind_null(s_, i);  // SQLite stores NaN as NULL anyway; say so
    } else {
      sqlite3_bind_double(s_, i, v);
    }
    return *this;
  }
  /// True while there is a row.
  bool step() {
    const int rc = sqlite3_step(s_);
    TORCH_CHECK(rc == SQLITE_ROW || rc == SQLITE_DONE, "tune storage: ", sqlite3_errmsg(db_));
    return rc == SQLITE_ROW;
  }
  std::string text(int i) const {
    const auto* p = sqlite3_column_text(s_, i);
    return p ? reinterpret_cast<const char*>(p) : "";
  }
  int64_t integer(int i) const { return sqlite3_column_int64(s_, i); }
  double real(int i) const {
    return sqlite3_column_type(s_, i) == SQLITE_NULL ? std::nan("") : sqlite3_column_double(s_, i);
  }

 private:
  sqlite3* db_;
  sqlite3_stmt* s_ = nullptr;
};

class SqliteStorage : public Storage {
 public:
  SqliteStorage(std::string url, const std::string& path) : url_(std::move(url)) {
    const int rc =
        sqlite3_open_v2(path.c_str(), &db_, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, nullptr);
    if (rc != SQLITE_OK) {
      const std::string why = db_ ? sqlite3_errmsg(db_) : sqlite3_errstr(rc);
      sqlite3_close(db_);
      db_ = nullptr;
      TORCH_CHECK(false, "tune storage: cannot open SQLite database ", path, ": ", why);
    }
    sqlite3_busy_timeout(db_, 30000);  // another tuner on the same file holds the lock briefly
    try {
      exec(kSchema);
    } catch (...) {
      sqlite3_close(db_);
      throw;
    }
  }
  ~SqliteStorage() override { sqlite3_close(db_); }

  void open_study(const StudySpec& spec) override {
    exec("BEGIN IMMEDIATE");
    try {
      Stmt q(db_, "SELECT space, metric, mode FROM studies WHERE name = ?");
      q.bind(1, spec.name);
      if (q.step()) {
        check_same(spec, q.text(0), q.text(1), q.text(2));
      } else {
        Stmt ins(db_, "INSERT INTO studies VALUES (?, ?, ?, ?, ?)");
        ins.bind(1, spec.name).bind(2, spec.space).bind(3, spec.metric).bind(4, spec.mode);
        ins.bind(5, now()).step();
      }
      exec("COMMIT");
    } catch (...) {
      exec("ROLLBACK");
      throw;
    }
    study_ = spec.name;
  }

  std::vector<TrialRecord> load_trials() override {
    std::vector<TrialRecord> out;
    Stmt q(db_,
           "SELECT number, state, params, attempts, exit_status, error, log_path, started, ended "
           "FROM trials WHERE study = ? ORDER BY number");
    q.bind(1, study_);
    while (q.step()) {
      TrialRecord r;
      r.number = q.integer(0);
      r.state = state_from(q.text(1));
      r.config = config_from(q.text(2));
      r.attempts = static_cast<int>(q.integer(3));
      r.exit_status = static_cast<int>(q.integer(4));
      r.error = q.text(5);
      r.log_path = q.text(6);
      r.started = q.real(7);
      r.ended = q.real(8);
      out.push_back(std::move(r));
    }
    Stmt res(db_,
             "SELECT number, iteration, value FROM results WHERE study = ? ORDER BY number, seq");
    res.bind(1, study_);
    size_t k = 0;
    while (res.step()) {
      const int64_t number = res.integer(0);
      while (k < out.size() && out[k].number < number) {
        ++k;
      }
      if (k < out.size() && out[k].number == number) {
        out[k].results.emplace_back(res.integer(1), res.real(2));
      }
    }
    return out;
  }

  void add_trial(const TrialRecord& r) override {
    Stmt ins(db_, "INSERT INTO trials VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)");
    ins.bind(1, study_).bind(2, r.number).bind(3, std::string(to_string(r.state)));
    ins.bind(4, config_json(r.config)).bind(5, static_cast<int64_t>(r.attempts));
    ins.bind(6, static_cast<int64_t>(r.exit_status)).bind(7, r.error).bind(8, r.log_path);
    ins.bind(9, r.started).bind(10, r.ended).step();
  }

  void update_trial(const TrialRecord& r) override {
    Stmt up(db_,
            "UPDATE trials SET state = ?, attempts = ?, exit_status = ?, error = ?, "
            "log_path = ?, started = ?, ended = ? WHERE study = ? AND number = ?");
    up.bind(1, std::string(to_string(r.state))).bind(2, static_cast<int64_t>(r.attempts));
    up.bind(3, static_cast<int64_t>(r.exit_status)).bind(4, r.error).bind(5, r.log_path);
    up.bind(6, r.started).bind(7, r.ended).bind(8, study_).bind(9, r.number).step();
  }

  void add_result(int64_t number,
                  int64_t iteration,
                  double value,
                  const std::string& row) override {
    Stmt ins(db_,
             "INSERT INTO results SELECT ?, ?, COALESCE(MAX(seq), -1) + 1, ?, ?, ?, ? "
             "FROM results WHERE study = ? AND number = ?");
    ins.bind(1, study_).bind(2, number).bind(3, iteration).bind(4, value).bind(5, row);
    ins.bind(6, now()).bind(7, study_).bind(8, number).step();
  }

  std::string url() const override { return url_; }

 private:
  void exec(const char* sql) {
    char* err = nullptr;
    if (sqlite3_exec(db_, sql, nullptr, nullptr, &err) != SQLITE_OK) {
      const std::string why = err ? err : "unknown error";
      sqlite3_free(err);
      TORCH_CHECK(false, "tune storage: ", why, " (", url_, ")");
    }
  }

  void check_same(const StudySpec& spec,
                  const std::string& space,
                  const std::string& metric,
                  const std::string& mode) {
    TORCH_CHECK(space == spec.space, "tune: study '", spec.name, "' in ", url_,
                " exists with a different search space; its trials are kept. Stored:\n", space,
                "given:\n", spec.space, "Use another --study name, or the stored space");
    TORCH_CHECK(metric == spec.metric && mode == spec.mode, "tune: study '", spec.name, "' in ",
                url_, " exists with --metric ", metric, " --mode ", mode, ", not --metric ",
                spec.metric, " --mode ", spec.mode, "; use another --study name");
  }

  std::string url_;
  sqlite3* db_ = nullptr;
  std::string study_;
};

}  // namespace

std::unique_ptr<Storage> open_storage(const std::string& url) {
  TORCH_CHECK(!url.empty(), "tune: --storage is empty; give sqlite:///study.db or a file path");
  const size_t scheme_end = url.find("://");
  if (scheme_end == std::string::npos) {
    return std::make_unique<SqliteStorage>(url, url);  // a plain path
  }
  const std::string scheme = url.substr(0, scheme_end);
  if (scheme == "sqlite") {
    TORCH_CHECK(url.compare(0, 10, "sqlite:///") == 0 && url.size() > 10,
                "tune: malformed storage URL '", url,
                "'; write sqlite:///relative/path.db or sqlite:////absolute/path.db");
    return std::make_unique<SqliteStorage>(url, url.substr(10));
  }
  TORCH_CHECK(scheme != "postgresql" && scheme != "postgres", "tune: storage '", url,
              "': PostgreSQL storage is not built into this paratrain yet; use sqlite:///FILE");
  TORCH_CHECK(false, "tune: unknown storage scheme '", scheme, "' in '", url,
              "'; use sqlite:///FILE (or a plain file path)");
}

}  // namespace tune
}  // namespace paratrain
