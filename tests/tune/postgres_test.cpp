// Tuners sharing one study in a real PostgreSQL server (Debian's postgresql: initdb in a
// temporary directory, run as the unprivileged postgres user when the tests run as root, reached
// over a Unix socket in that directory).

#include "paratrain/tune/tuner.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <pwd.h>
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>

namespace paratrain {
namespace tune {
namespace {

using testing::run_process;

std::string postgres_bin() {
  std::string best;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/usr/lib/postgresql", ec)) {
    const std::string bin = e.path().string() + "/bin";
    if (::access((bin + "/initdb").c_str(), X_OK) == 0 && bin > best) {
      best = bin;
    }
  }
  return best;
}

// A PostgreSQL server of its own, stopped and removed at the end.
class PostgresServer {
 public:
  PostgresServer() : dir_(::testing::TempDir() + testing::unique_token("pg")) {
    bin_ = postgres_bin();
    if (bin_.empty()) {
      return;
    }
    std::filesystem::create_directories(dir_);
    if (::getuid() == 0) {  // the server refuses to run as root
      const passwd* pw = ::getpwnam("postgres");
      if (pw == nullptr || ::chown(dir_.c_str(), pw->pw_uid, pw->pw_gid) != 0) {
        why_ = "no postgres user to run the server as";
        return;
      }
      const std::string runuser =
          ::access("/usr/sbin/runuser", X_OK) == 0 ? "/usr/sbin/runuser" : "/sbin/runuser";
      as_ = {runuser, "-u", "postgres", "--"};
    }
    auto initdb =
        as({bin_ + "/initdb", "-D", dir_ + "/data", "-A", "trust", "-U", "paratrain", "--no-sync"});
    const auto r = run_process(initdb, {}, 120);
    if (r.exit_code != 0) {
      why_ = "initdb failed (exit " + std::to_string(r.exit_code) + ", signal " +
             std::to_string(r.signal) + "): " + r.output;
      return;
    }
    const auto start = run_process(as({bin_ + "/pg_ctl", "-D", dir_ + "/data", "-o",
                                       "-k " + dir_ + " -c listen_addresses='' -c fsync=off", "-l",
                                       dir_ + "/pg.log", "-w", "start"}),
                                   {}, 120);
    if (start.exit_code != 0) {
      why_ = "pg_ctl start failed: " + start.output;
      return;
    }
    running_ = true;
  }
  ~PostgresServer() {
    if (running_) {
      run_process(as({bin_ + "/pg_ctl", "-D", dir_ + "/data", "-m", "immediate", "stop"}), {}, 60);
    }
    paratrain::testing::remove_tree(dir_);
  }
  bool running() const { return running_; }
  /// The server's binaries exist (else the tests skip); a server that then fails to start is a
  /// test failure, not a skip.
  bool installed() const { return !bin_.empty(); }
  std::string why() const {
    return bin_.empty() ? "no PostgreSQL server (/usr/lib/postgresql)" : why_;
  }
  std::string url() const { return "postgresql://paratrain@/postgres?host=" + dir_; }
  std::string dir() const { return dir_; }

 private:
  std::vector<std::string> as(std::vector<std::string> argv) const {
    argv.insert(argv.begin(), as_.begin(), as_.end());
    return argv;
  }
  std::string dir_, bin_, why_;
  std::vector<std::string> as_;
  bool running_ = false;
};

std::vector<std::string> worker_argv(const PostgresServer& pg,
                                     const std::string& script,
                                     const std::vector<std::string>& extra) {
  std::vector<std::string> argv{testing::cli_path(),
                                "tune",
                                "--storage",
                                pg.url(),
                                "--study",
                                "shared",
                                "--metric",
                                "loss",
                                "--mode",
                                "min",
                                "--searcher",
                                "tpe",
                                "--space",
                                "x=uniform(0, 1)",
                                "--num-samples",
                                "8",
                                "--max-concurrent",
                                "1",
                                "--cpus",
                                "1",
                                "--trial-dir",
                                pg.dir() + "/trials"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.insert(argv.end(), {"--", script});
  return argv;
}

std::string trial_script(const std::string& dir) {
  const std::string path = dir + "/trial.sh";
  std::ofstream(path) << "#!/bin/sh\necho $PARATRAIN_TRIAL_NUMBER >> " << dir
                      << "/runs\nfor i in 1 2 3; do sleep 0.1; "
                         "echo \"{\\\"loss\\\": $x}\"; done\n";
  std::filesystem::permissions(path, std::filesystem::perms::all);
  return path;
}

std::vector<TrialRecord> stored(const PostgresServer& pg) {
  auto st = open_storage(pg.url());
  SearchSpace s;
  s.add("x=uniform(0, 1)");
  st->open_study({"shared", s.canonical(), "loss", "min"});
  return st->load_trials();
}

TEST(TunePostgres, TwoWorkersShareAStudyAndNoTrialRunsTwice) {
  PostgresServer pg;
  if (!pg.installed()) {
    GTEST_SKIP() << pg.why();
  }
  ASSERT_TRUE(pg.running()) << pg.why();
  const std::string script = trial_script(pg.dir());
  auto a = testing::start_process(worker_argv(pg, script, {}));
  auto b = testing::start_process(worker_argv(pg, script, {}));
  const auto ra = a.finish(180), rb = b.finish(180);
  ASSERT_EQ(ra.exit_code, 0) << ra.output;
  ASSERT_EQ(rb.exit_code, 0) << rb.output;
  const auto trials = stored(pg);
  ASSERT_EQ(trials.size(), 8u);
  std::set<std::string> workers;
  for (const auto& t : trials) {
    EXPECT_EQ(t.state, TrialState::kComplete) << t.number;
    EXPECT_EQ(t.results.size(), 3u) << t.number;
    workers.insert(t.worker);
  }
  EXPECT_EQ(workers.size(), 2u) << "both tuners ran trials";
  std::map<int, int> runs;
  std::ifstream in(pg.dir() + "/runs");
  for (int n = 0; in >> n;) {
    runs[n]++;
  }
  ASSERT_EQ(runs.size(), 8u);
  for (const auto& [n, count] : runs) {
    EXPECT_EQ(count, 1) << "trial " << n << " ran " << count << " times";
  }
}

TEST(TunePostgres, ADeadWorkersTrialIsRetriedByAnother) {
  PostgresServer pg;
  if (!pg.installed()) {
    GTEST_SKIP() << pg.why();
  }
  ASSERT_TRUE(pg.running()) << pg.why();
  const std::string script = trial_script(pg.dir());
  {
    // A tuner on another host took trial 0 and went silent: no heartbeat since.
    auto st = open_storage(pg.url());
    SearchSpace s;
    s.add("x=uniform(0, 1)");
    st->open_study({"shared", s.canonical(), "loss", "min"});
    ASSERT_EQ(st->reserve_trial(8, "elsewhere:1"), 0);
    st->set_config(0, {{"x", 0.5}});
  }
  const auto r = run_process(worker_argv(pg, script, {"--heartbeat-timeout", "2"}), {}, 180);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("trial 0: its tuner elsewhere:1 is gone"), std::string::npos) << r.output;
  const auto trials = stored(pg);
  ASSERT_EQ(trials.size(), 8u);
  EXPECT_EQ(trials[0].state, TrialState::kComplete);
  EXPECT_EQ(trials[0].attempts, 1);
  for (const auto& t : trials) {
    EXPECT_EQ(t.state, TrialState::kComplete) << t.number;
  }
}

TEST(TunePostgres, BadUrlsAreOneLine) {
  EXPECT_NE(testing::error_of([] {
              open_storage("postgresql://nobody@/x?host=/nonexistent-dir");
            }).find("cannot connect to PostgreSQL at postgresql://nobody@/x?host=/nonexistent-dir"),
            std::string::npos);
  const std::string e =
      testing::error_of([] { open_storage("postgresql://u:secret@/x?host=/nonexistent-dir"); });
  EXPECT_EQ(e.find("secret"), std::string::npos) << e;
  EXPECT_NE(e.find("u:***@"), std::string::npos) << e;
  EXPECT_EQ(std::count(e.begin(), e.end(), '\n'), 0) << e;
}

}  // namespace
}  // namespace tune
}  // namespace paratrain
