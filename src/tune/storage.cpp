#include "paratrain/tune/storage.h"

#include <c10/util/Exception.h>
#ifdef PARATRAIN_WITH_POSTGRESQL
#include <libpq-fe.h>
#endif
#include <sqlite3.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <variant>

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

double now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// One SQL parameter or column: NULL, an integer, a float or text.
using Param = std::variant<std::monostate, int64_t, double, std::string>;
using Row = std::vector<std::optional<std::string>>;

// The little the storage needs from a database: statements with '?' parameters, each returning
// its rows as text, and a transaction that holds the study's lock.
class Db {
 public:
  virtual ~Db() = default;
  virtual std::vector<Row> query(const std::string& sql, const std::vector<Param>& params = {}) = 0;
  /// BEGIN, holding a lock that serializes the tuners of one database.
  virtual void begin_locked() = 0;
  /// The tables, created when missing.
  virtual void create_schema() = 0;
  virtual bool has_table(const std::string& name) = 0;
};

// The exploit steps of population-based training, added after the first release: a database
// opened read-only may not have the table yet.
const char* const kExploitsTable =
    "CREATE TABLE IF NOT EXISTS exploits (study TEXT NOT NULL, seq BIGINT NOT NULL, "
    "trial BIGINT NOT NULL, source BIGINT NOT NULL, iteration BIGINT NOT NULL, "
    "source_iteration BIGINT NOT NULL, old_params TEXT NOT NULL, new_params TEXT NOT NULL, "
    "time DOUBLE PRECISION NOT NULL, PRIMARY KEY (study, seq))";

// ---- SQLite (Debian's libsqlite3) ----
class SqliteDb : public Db {
 public:
  SqliteDb(const std::string& path, const std::string& url, bool read_only) : url_(url) {
    const int flags = read_only ? SQLITE_OPEN_READONLY : SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE;
    const int rc = sqlite3_open_v2(path.c_str(), &db_, flags, nullptr);
    if (rc != SQLITE_OK) {
      const std::string why = db_ ? sqlite3_errmsg(db_) : sqlite3_errstr(rc);
      sqlite3_close(db_);
      TORCH_CHECK(false, "tune storage: cannot open SQLite database ", path, ": ", why);
    }
    sqlite3_busy_timeout(db_, 60000);  // another tuner on the same file holds the lock briefly
  }
  ~SqliteDb() override { sqlite3_close(db_); }

  std::vector<Row> query(const std::string& sql, const std::vector<Param>& params) override {
    sqlite3_stmt* st = nullptr;
    TORCH_CHECK(sqlite3_prepare_v2(db_, sql.c_str(), -1, &st, nullptr) == SQLITE_OK,
                "tune storage: ", sqlite3_errmsg(db_), " (", url_, ")");
    std::unique_ptr<sqlite3_stmt, int (*)(sqlite3_stmt*)> guard(st, sqlite3_finalize);
    for (size_t i = 0; i < params.size(); ++i) {
      const int k = static_cast<int>(i + 1);
      const Param& p = params[i];
      if (const auto* v = std::get_if<int64_t>(&p)) {
        sqlite3_bind_int64(st, k, *v);
      } else if (const auto* d = std::get_if<double>(&p)) {
        sqlite3_bind_double(st, k, *d);
      } else if (const auto* t = std::get_if<std::string>(&p)) {
        sqlite3_bind_text(st, k, t->c_str(), static_cast<int>(t->size()), SQLITE_TRANSIENT);
      } else {
        sqlite3_bind_null(st, k);
      }
    }
    std::vector<Row> rows;
    while (true) {
      const int rc = sqlite3_step(st);
      if (rc == SQLITE_DONE) {
        return rows;
      }
      TORCH_CHECK(rc == SQLITE_ROW, "tune storage: ", sqlite3_errmsg(db_), " (", url_, ")");
      Row row;
      for (int c = 0; c < sqlite3_column_count(st); ++c) {
        const int type = sqlite3_column_type(st, c);
        if (type == SQLITE_NULL) {
          row.emplace_back();
        } else if (type == SQLITE_FLOAT) {  // all 17 digits: SQLite's own text keeps 15
          char buf[32];
          std::snprintf(buf, sizeof(buf), "%.17g", sqlite3_column_double(st, c));
          row.emplace_back(buf);
        } else {
          row.emplace_back(reinterpret_cast<const char*>(sqlite3_column_text(st, c)));
        }
      }
      rows.push_back(std::move(row));
    }
  }

  void begin_locked() override { query("BEGIN IMMEDIATE", {}); }

  void create_schema() override {
    for (const char* sql :
         {"CREATE TABLE IF NOT EXISTS studies (name TEXT PRIMARY KEY, space TEXT NOT NULL, "
          "metric TEXT NOT NULL, mode TEXT NOT NULL, created REAL NOT NULL)",
          "CREATE TABLE IF NOT EXISTS trials (study TEXT NOT NULL, number INTEGER NOT NULL, "
          "state TEXT NOT NULL, params TEXT NOT NULL, attempts INTEGER NOT NULL, "
          "exit_status INTEGER NOT NULL, error TEXT NOT NULL, log_path TEXT NOT NULL, "
          "started REAL NOT NULL, ended REAL NOT NULL, worker TEXT NOT NULL, "
          "heartbeat REAL NOT NULL, PRIMARY KEY (study, number))",
          "CREATE TABLE IF NOT EXISTS results (study TEXT NOT NULL, number INTEGER NOT NULL, "
          "seq INTEGER NOT NULL, iteration INTEGER NOT NULL, value REAL, row TEXT NOT NULL, "
          "time REAL NOT NULL, PRIMARY KEY (study, number, seq))",
          kExploitsTable}) {
      query(sql, {});
    }
  }

  bool has_table(const std::string& name) override {
    return !query("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", {name}).empty();
  }

 private:
  std::string url_;
  sqlite3* db_ = nullptr;
};

#ifdef PARATRAIN_WITH_POSTGRESQL
// ---- PostgreSQL (Debian's libpq) ----
class PgDb : public Db {
 public:
  PgDb(const std::string& url, const std::string& shown, bool read_only) : shown_(shown) {
    conn_ = PQconnectdb(url.c_str());
    if (PQstatus(conn_) != CONNECTION_OK) {
      std::string why = PQerrorMessage(conn_);
      PQfinish(conn_);
      while (!why.empty() && (why.back() == '\n' || why.back() == ' ')) {
        why.pop_back();
      }
      for (size_t nl = why.find('\n'); nl != std::string::npos; nl = why.find('\n')) {
        why[nl] = ' ';  // one line
      }
      TORCH_CHECK(false, "tune storage: cannot connect to PostgreSQL at ", shown_, ": ", why);
    }
    // The server's NOTICEs ("relation ... already exists, skipping") are not the user's concern.
    PQsetNoticeProcessor(
        conn_, [](void*, const char*) {}, nullptr);
    if (read_only) {
      query("SET default_transaction_read_only = on", {});
    }
  }
  ~PgDb() override { PQfinish(conn_); }

  std::vector<Row> query(const std::string& sql, const std::vector<Param>& params) override {
    std::string text;  // '?' -> $1, $2, ...
    int k = 0;
    for (char c : sql) {
      text += c == '?' ? "$" + std::to_string(++k) : std::string(1, c);
    }
    std::vector<std::string> values(params.size());
    std::vector<const char*> ptrs(params.size(), nullptr);
    for (size_t i = 0; i < params.size(); ++i) {
      const Param& p = params[i];
      if (const auto* v = std::get_if<int64_t>(&p)) {
        values[i] = std::to_string(*v);
      } else if (const auto* d = std::get_if<double>(&p)) {
        char buf[32];
        std::snprintf(buf, sizeof(buf), "%.17g", *d);
        values[i] = std::isfinite(*d) ? buf : *d > 0 ? "Infinity" : "-Infinity";
      } else if (const auto* t = std::get_if<std::string>(&p)) {
        values[i] = *t;
      } else {
        continue;  // NULL
      }
      ptrs[i] = values[i].c_str();
    }
    PGresult* res = PQexecParams(conn_, text.c_str(), static_cast<int>(params.size()), nullptr,
                                 ptrs.data(), nullptr, nullptr, 0);
    std::unique_ptr<PGresult, void (*)(PGresult*)> guard(res, PQclear);
    const auto status = PQresultStatus(res);
    if (status != PGRES_TUPLES_OK && status != PGRES_COMMAND_OK) {
      std::string why = PQresultErrorMessage(res);
      while (!why.empty() && why.back() == '\n') {
        why.pop_back();
      }
      TORCH_CHECK(false, "tune storage: PostgreSQL at ", shown_, ": ", why);
    }
    std::vector<Row> rows;
    for (int r = 0; r < PQntuples(res); ++r) {
      Row row;
      for (int c = 0; c < PQnfields(res); ++c) {
        if (PQgetisnull(res, r, c)) {
          row.emplace_back();
        } else {
          row.emplace_back(PQgetvalue(res, r, c));
        }
      }
      rows.push_back(std::move(row));
    }
    return rows;
  }

  bool has_table(const std::string& name) override {
    const auto rows = query("SELECT to_regclass(?) IS NOT NULL", {name});
    return !rows.empty() && rows[0].at(0).value_or("") == "t";
  }

  void begin_locked() override {
    query("BEGIN", {});
    query("SELECT pg_advisory_xact_lock(7418322)", {});  // paratrain's lock: one at a time
  }

  void create_schema() override {
    begin_locked();  // two workers creating the tables at once would collide in the catalog
    try {
      for (const char* sql :
           {"CREATE TABLE IF NOT EXISTS studies (name TEXT PRIMARY KEY, space TEXT NOT NULL, "
            "metric TEXT NOT NULL, mode TEXT NOT NULL, created DOUBLE PRECISION NOT NULL)",
            "CREATE TABLE IF NOT EXISTS trials (study TEXT NOT NULL, number BIGINT NOT NULL, "
            "state TEXT NOT NULL, params TEXT NOT NULL, attempts BIGINT NOT NULL, "
            "exit_status BIGINT NOT NULL, error TEXT NOT NULL, log_path TEXT NOT NULL, "
            "started DOUBLE PRECISION NOT NULL, ended DOUBLE PRECISION NOT NULL, "
            "worker TEXT NOT NULL, heartbeat DOUBLE PRECISION NOT NULL, "
            "PRIMARY KEY (study, number))",
            "CREATE TABLE IF NOT EXISTS results (study TEXT NOT NULL, number BIGINT NOT NULL, "
            "seq BIGINT NOT NULL, iteration BIGINT NOT NULL, value DOUBLE PRECISION, "
            "row TEXT NOT NULL, time DOUBLE PRECISION NOT NULL, "
            "PRIMARY KEY (study, number, seq))",
            kExploitsTable}) {
        query(sql, {});
      }
      query("COMMIT", {});
    } catch (...) {
      query("ROLLBACK", {});
      throw;
    }
  }

 private:
  std::string shown_;
  PGconn* conn_ = nullptr;
};

#endif

std::string text_of(const Row& row, size_t i) {
  return row.at(i).value_or("");
}
int64_t int_of(const Row& row, size_t i) {
  return row.at(i) ? std::stoll(*row[i]) : 0;
}
double real_of(const Row& row, size_t i) {
  if (!row.at(i)) {
    return std::nan("");
  }
  const std::string& t = *row[i];
  return t == "Infinity"    ? HUGE_VAL
         : t == "-Infinity" ? -HUGE_VAL
                            : std::strtod(t.c_str(), nullptr);
}

class SqlStorage : public Storage {
 public:
  SqlStorage(std::unique_ptr<Db> db, std::string url, bool read_only)
      : db_(std::move(db)), url_(std::move(url)) {
    if (!read_only) {
      db_->create_schema();
    }
  }

  void open_study(const StudySpec& spec) override {
    locked([&] {
      const auto rows =
          db_->query("SELECT space, metric, mode FROM studies WHERE name = ?", {spec.name});
      if (!rows.empty()) {
        check_same(spec, text_of(rows[0], 0), text_of(rows[0], 1), text_of(rows[0], 2));
      } else {
        db_->query("INSERT INTO studies VALUES (?, ?, ?, ?, ?)",
                   {spec.name, spec.space, spec.metric, spec.mode, now()});
      }
    });
    study_ = spec.name;
  }

  StudySpec load_study(const std::string& name) override {
    const auto rows = db_->query("SELECT space, metric, mode FROM studies WHERE name = ?", {name});
    if (rows.empty()) {
      std::string names;
      for (const Row& r : db_->query("SELECT name FROM studies ORDER BY name", {})) {
        names += (names.empty() ? "" : ", ") + text_of(r, 0);
      }
      TORCH_CHECK(false, "tune: no study '", name, "' in ", url_, " (it has ",
                  names.empty() ? std::string("none") : names, ")");
    }
    study_ = name;
    return {name, text_of(rows[0], 0), text_of(rows[0], 1), text_of(rows[0], 2)};
  }

  std::vector<TrialRecord> load_trials() override {
    std::vector<TrialRecord> out;
    for (const Row& q : db_->query(
             "SELECT number, state, params, attempts, exit_status, error, log_path, started, "
             "ended, worker, heartbeat FROM trials WHERE study = ? ORDER BY number",
             {study_})) {
      TrialRecord r;
      r.number = int_of(q, 0);
      r.state = state_from(text_of(q, 1));
      r.config = config_from(text_of(q, 2));
      r.attempts = static_cast<int>(int_of(q, 3));
      r.exit_status = static_cast<int>(int_of(q, 4));
      r.error = text_of(q, 5);
      r.log_path = text_of(q, 6);
      r.started = real_of(q, 7);
      r.ended = real_of(q, 8);
      r.worker = text_of(q, 9);
      r.heartbeat = real_of(q, 10);
      out.push_back(std::move(r));
    }
    size_t k = 0;
    for (const Row& q : db_->query("SELECT number, iteration, value FROM results WHERE study = ? "
                                   "ORDER BY number, seq",
                                   {study_})) {
      const int64_t number = int_of(q, 0);
      while (k < out.size() && out[k].number < number) {
        ++k;
      }
      if (k < out.size() && out[k].number == number) {
        out[k].results.emplace_back(int_of(q, 1), real_of(q, 2));
      }
    }
    return out;
  }

  void add_trial(const TrialRecord& r) override {
    db_->query("INSERT INTO trials VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
               {study_, r.number, std::string(to_string(r.state)), config_json(r.config),
                int64_t{r.attempts}, int64_t{r.exit_status}, r.error, r.log_path, r.started,
                r.ended, r.worker, now()});
  }

  int64_t reserve_trial(int64_t limit, const std::string& worker) override {
    int64_t number = -1;
    locked([&] {
      const auto rows = db_->query(
          "SELECT COALESCE(MAX(number) + 1, 0), COUNT(*) FROM trials WHERE study = ?", {study_});
      if (int_of(rows.at(0), 1) >= limit) {
        return;
      }
      number = int_of(rows[0], 0);
      TrialRecord r;
      r.number = number;
      r.state = TrialState::kRunning;
      r.worker = worker;
      add_trial(r);
    });
    return number;
  }

  void set_config(int64_t number, const Config& config) override {
    db_->query("UPDATE trials SET params = ? WHERE study = ? AND number = ?",
               {config_json(config), study_, number});
  }

  bool claim_trial(int64_t number, const std::string& worker) override {
    return !db_->query(
                   "UPDATE trials SET state = 'RUNNING', worker = ?, heartbeat = ? "
                   "WHERE study = ? AND number = ? AND state = 'PENDING' RETURNING number",
                   {worker, now(), study_, number})
                .empty();
  }

  bool release_trial(int64_t number,
                     const std::string& worker,
                     double seen_heartbeat,
                     bool count_attempt) override {
    // The heartbeat must still be the one the caller judged stale: a renewed one means the
    // worker is alive after all.
    return !db_->query(
                   "UPDATE trials SET state = 'PENDING', worker = '', "
                   "attempts = attempts + ? WHERE study = ? AND number = ? AND "
                   "state = 'RUNNING' AND worker = ? AND heartbeat <= ? RETURNING number",
                   {int64_t{count_attempt ? 1 : 0}, study_, number, worker, seen_heartbeat})
                .empty();
  }

  std::vector<int64_t> heartbeat(const std::string& worker) override {
    std::vector<int64_t> held;
    for (const Row& r : db_->query("UPDATE trials SET heartbeat = ? WHERE study = ? AND "
                                   "worker = ? AND state = 'RUNNING' RETURNING number",
                                   {now(), study_, worker})) {
      held.push_back(int_of(r, 0));
    }
    return held;
  }

  bool update_trial(const TrialRecord& r,
                    TrialState from,
                    const std::string& from_worker) override {
    return !db_->query(
                   "UPDATE trials SET state = ?, attempts = ?, exit_status = ?, error = ?, "
                   "log_path = ?, started = ?, ended = ?, worker = ?, heartbeat = ? "
                   "WHERE study = ? AND number = ? AND state = ? AND (? = '' OR worker = ?) "
                   "RETURNING number",
                   {std::string(to_string(r.state)), int64_t{r.attempts}, int64_t{r.exit_status},
                    r.error, r.log_path, r.started, r.ended, r.worker, now(), study_, r.number,
                    std::string(to_string(from)), from_worker, from_worker})
                .empty();
  }

  bool add_result(int64_t number,
                  int64_t iteration,
                  double value,
                  const std::string& row,
                  const std::string& worker) override {
    return !db_->query(
                   "INSERT INTO results SELECT ?, ?, (SELECT COALESCE(MAX(seq), -1) + 1 "
                   "FROM results WHERE study = ? AND number = ?), ?, ?, ?, ? WHERE EXISTS "
                   "(SELECT 1 FROM trials WHERE study = ? AND number = ? AND "
                   "state = 'RUNNING' AND worker = ?) RETURNING number",
                   {study_, number, study_, number, iteration,
                    std::isnan(value) ? Param{} : Param{value}, row, now(), study_, number, worker})
                .empty();
  }

  void add_exploit(const ExploitRecord& e) override {
    locked([&] {  // the lock also keeps two tuners from taking the same seq
      db_->query(
          "INSERT INTO exploits SELECT ?, (SELECT COALESCE(MAX(seq), -1) + 1 FROM exploits "
          "WHERE study = ?), ?, ?, ?, ?, ?, ?, ?",
          {study_, study_, e.trial, e.source, e.iteration, e.source_iteration,
           config_json(e.old_config), config_json(e.new_config), e.time});
      set_config(e.trial, e.new_config);
    });
  }

  std::vector<ExploitRecord> load_exploits() override {
    std::vector<ExploitRecord> out;
    if (!db_->has_table("exploits")) {
      return out;  // a study stored before exploits were
    }
    for (const Row& q :
         db_->query("SELECT trial, source, iteration, source_iteration, old_params, new_params, "
                    "time FROM exploits WHERE study = ? ORDER BY seq",
                    {study_})) {
      ExploitRecord e;
      e.trial = int_of(q, 0);
      e.source = int_of(q, 1);
      e.iteration = int_of(q, 2);
      e.source_iteration = int_of(q, 3);
      e.old_config = config_from(text_of(q, 4));
      e.new_config = config_from(text_of(q, 5));
      e.time = real_of(q, 6);
      out.push_back(std::move(e));
    }
    return out;
  }

  std::vector<StudySpec> list_studies() override {
    std::vector<StudySpec> out;
    for (const Row& q : db_->query("SELECT name, space, metric, mode FROM studies ORDER BY name")) {
      out.push_back({text_of(q, 0), text_of(q, 1), text_of(q, 2), text_of(q, 3)});
    }
    return out;
  }

  std::string url() const override { return url_; }

 private:
  void locked(const std::function<void()>& body) {
    db_->begin_locked();
    try {
      body();
      db_->query("COMMIT", {});
    } catch (...) {
      try {
        db_->query("ROLLBACK", {});
      } catch (...) {
      }
      throw;
    }
  }

  void check_same(const StudySpec& spec,
                  const std::string& space,
                  const std::string& metric,
                  const std::string& mode) {
    auto one_line = [](std::string text) {
      while (!text.empty() && text.back() == '\n') {
        text.pop_back();
      }
      for (auto& c : text) {
        c = c == '\n' ? ';' : c;
      }
      return text;
    };
    TORCH_CHECK(space == spec.space, "tune: study '", spec.name, "' in ", url_,
                " exists with a different search space (stored: ", one_line(space),
                "; given: ", one_line(spec.space),
                "); its trials are kept; use another --study name, or the stored space");
    if ((metric != spec.metric || mode != spec.mode) &&
        db_->query("SELECT 1 FROM results WHERE study = ? LIMIT 1", {spec.name}).empty()) {
      // Nothing was measured yet: a mistyped --metric may still be corrected.
      db_->query("UPDATE studies SET metric = ?, mode = ? WHERE name = ?",
                 {spec.metric, spec.mode, spec.name});
      return;
    }
    TORCH_CHECK(metric == spec.metric && mode == spec.mode, "tune: study '", spec.name, "' in ",
                url_, " exists with --metric ", metric, " --mode ", mode, ", not --metric ",
                spec.metric, " --mode ", spec.mode, "; use another --study name");
  }

  std::unique_ptr<Db> db_;
  std::string url_;
  std::string study_;
};

// The URL with its password hidden, for messages.
std::string shown_url(const std::string& url) {
  const size_t scheme = url.find("://");
  const size_t at = url.find('@');
  if (scheme == std::string::npos || at == std::string::npos) {
    return url;
  }
  const size_t colon = url.find(':', scheme + 3);
  if (colon == std::string::npos || colon > at) {
    return url;
  }
  return url.substr(0, colon + 1) + "***" + url.substr(at);
}

}  // namespace

std::unique_ptr<Storage> open_storage(const std::string& url, bool read_only) {
  TORCH_CHECK(!url.empty(), "tune: --storage is empty; give sqlite:///study.db or a file path");
  const size_t scheme_end = url.find("://");
  if (scheme_end == std::string::npos) {
    return std::make_unique<SqlStorage>(std::make_unique<SqliteDb>(url, url, read_only), url,
                                        read_only);
  }
  const std::string scheme = url.substr(0, scheme_end);
  if (scheme == "sqlite") {
    TORCH_CHECK(url.compare(0, 10, "sqlite:///") == 0 && url.size() > 10,
                "tune: malformed storage URL '", url,
                "'; write sqlite:///relative/path.db or sqlite:////absolute/path.db");
    return std::make_unique<SqlStorage>(std::make_unique<SqliteDb>(url.substr(10), url, read_only),
                                        url, read_only);
  }
  if (scheme == "postgresql" || scheme == "postgres") {
    const std::string shown = shown_url(url);
#ifdef PARATRAIN_WITH_POSTGRESQL
    return std::make_unique<SqlStorage>(std::make_unique<PgDb>(url, shown, read_only), shown,
                                        read_only);
#else
    TORCH_CHECK(false, "tune: storage ", shown,
                ": this paratrain was built without libpq (install libpq-dev and rebuild)");
#endif
  }
  TORCH_CHECK(false, "tune: unknown storage scheme '", scheme, "' in '", shown_url(url),
              "'; use sqlite:///FILE (or a file path) or postgresql://USER@HOST/DB");
}

}  // namespace tune
}  // namespace paratrain
