// paratrain tune serve: a page opened in headless Chromium (Debian's chromium, driven by its
// chromedriver over WebDriver) shows a trial that completes after it was opened, without a
// reload; a study named like a script renders as text; unknown paths, a broken storage and the
// command line's bad input.

#include "paratrain/tune/dashboard.h"
#include "paratrain/launch/launch.h"
#include "paratrain/tune/tuner.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>
#include <vector>

namespace paratrain {
namespace tune {
namespace dashboard_tests {  // named: the unity build puts other tests' helpers beside these

using Json = nlohmann::json;

struct Dir {
  std::string path = testing::make_temp_dir("tune-serve");
  ~Dir() { testing::remove_tree(path); }
};

SearchSpace lr_space() {
  SearchSpace space;
  space.add("lr=loguniform(1e-4, 1)");
  return space;
}

TunerOptions study_options(const Dir& dir, const std::string& storage, const std::string& name) {
  return TunerOptions()
      .storage(storage)
      .study(name)
      .metric("loss")
      .cpus(1)
      .output("none")
      .trial_dir(dir.path + "/t");
}

// A study of one finished trial.
void one_trial_study(const Dir& dir, const std::string& storage, const std::string& name) {
  tune(lr_space(), study_options(dir, storage, name), [](TrialContext& t) {
    t.report({{"loss", 1.0}});
  });
}

// A dashboard on a free port, serving on its own thread.
struct Served {
  Dashboard dashboard;
  std::thread thread;
  explicit Served(const std::string& storage)
      : dashboard(DashboardOptions().storage(storage).port(0).refresh_seconds(0.3)) {
    thread = std::thread([this] { dashboard.run(); });
  }
  ~Served() {
    dashboard.stop();
    thread.join();
  }
  std::string url(const std::string& path) const {
    return "http://127.0.0.1:" + std::to_string(dashboard.port()) + path;
  }
};

// Headless Chromium through chromedriver's WebDriver endpoints (W3C WebDriver).
class Browser {
 public:
  Browser(const std::string& driver, const std::string& dir) : port_(testing::free_port()) {
    process_ = testing::start_process({driver, "--port=" + std::to_string(port_)}, {{"HOME", dir}});
    client_ = std::make_unique<httplib::Client>("127.0.0.1", port_);
    client_->set_read_timeout(60, 0);
    for (int i = 0; i < 100 && !ready(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    const Json caps{
        {"capabilities",
         {{"alwaysMatch",
           {{"unhandledPromptBehavior", "ignore"},
            {"goog:chromeOptions",
             {{"binary", dist::find_program("chromium")},
              {"args",
               {"--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--user-data-dir=" + dir + "/profile"}}}}}}}}};
    session_ = call("POST", "/session", caps).at("sessionId").get<std::string>();
  }
  ~Browser() {
    if (!session_.empty()) {
      client_->Delete(("/session/" + session_).c_str());
    }
    ::kill(process_.pid, SIGTERM);
    process_.finish(10);
  }
  void open(const std::string& url) { call("POST", path("/url"), {{"url", url}}); }
  Json run(const std::string& script) {
    return call("POST", path("/execute/sync"), {{"script", script}, {"args", Json::array()}});
  }
  std::string text() { return run("return document.body.innerText;").get<std::string>(); }
  /// Whether an alert() is open (WebDriver answers "no such alert" otherwise).
  bool alert_open() {
    auto r = client_->Get(path("/alert/text").c_str());
    return r && r->status == 200;
  }
  // Waits until the page's text contains `what`.
  bool wait_for_text(const std::string& what, double seconds) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (std::chrono::steady_clock::now() < end) {
      if (text().find(what) != std::string::npos) {
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    return false;
  }

 private:
  bool ready() {
    auto r = client_->Get("/status");
    return r && r->status == 200 && Json::parse(r->body, nullptr, false).is_object();
  }
  std::string path(const std::string& tail) const { return "/session/" + session_ + tail; }
  Json call(const std::string& method, const std::string& where, const Json& body) {
    auto r = method == "POST" ? client_->Post(where.c_str(), body.dump(), "application/json")
                              : client_->Get(where.c_str());
    if (!r) {
      throw std::runtime_error("chromedriver did not answer " + where);
    }
    const Json j = Json::parse(r->body, nullptr, false);
    if (r->status != 200 || j.is_discarded()) {
      throw std::runtime_error("chromedriver " + where + ": " + r->body);
    }
    return j.at("value");
  }

  int port_;
  testing::RunningProcess process_;
  std::unique_ptr<httplib::Client> client_;
  std::string session_;
};

std::string find_chromedriver() {
  if (dist::find_program("chromium").empty() || dist::find_program("chromedriver").empty()) {
    return "";
  }
  return dist::find_program("chromedriver");
}

TEST(TuneServe, PageShowsATrialThatCompletesAfterItWasOpened) {
  const std::string driver = find_chromedriver();
  if (driver.empty()) {
    GTEST_SKIP() << "no chromium and chromedriver (scripts/setup.sh installs them)";
  }
  Dir dir;
  const std::string db = "sqlite:///" + dir.path + "/s.db";
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  std::thread tuner([&] {
    tune(lr_space(), study_options(dir, db, "live"), [&](TrialContext& t) {
      t.report({{"training_iteration", 1}, {"loss", 1.0}});
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return release; });
      lock.unlock();
      t.report({{"training_iteration", 2}, {"loss", 0.5}});
    });
  });
  auto release_trial = [&] {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
    cv.notify_all();
  };
  try {
    // The page is opened while the trial runs.
    for (int i = 0; i < 300; ++i) {
      try {
        auto st = open_storage(db, true);
        st->load_study("live");
        const auto trials = st->load_trials();
        if (!trials.empty() && !trials[0].results.empty()) {
          break;
        }
      } catch (const std::exception&) {  // the tuner has not made the file or the study yet
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    Served served(db);
    Browser browser(driver, dir.path);
    browser.open(served.url("/study?name=live"));
    EXPECT_TRUE(browser.wait_for_text("RUNNING", 20)) << browser.text();
    EXPECT_EQ(browser.text().find("COMPLETE"), std::string::npos);
    browser.run("window.openedOnce = 42;");  // a reload would lose it
    browser.run("window.scrollTo(0, 200);");
    release_trial();
    tuner.join();
    EXPECT_TRUE(browser.wait_for_text("COMPLETE", 30)) << browser.text();
    EXPECT_EQ(browser.run("return window.openedOnce;").get<int>(), 42) << "the page reloaded";
    // The studies page lists it, with a link that opens it.
    browser.open(served.url("/"));
    EXPECT_TRUE(browser.wait_for_text("live", 10)) << browser.text();
    EXPECT_EQ(browser.run("return document.querySelector('a[href*=\"name=live\"]') !== null;"),
              true);
  } catch (...) {
    release_trial();
    if (tuner.joinable()) {
      tuner.join();
    }
    throw;
  }
}

TEST(TuneServe, AStudyNamedLikeAScriptRendersAsText) {
  const std::string driver = find_chromedriver();
  if (driver.empty()) {
    GTEST_SKIP() << "no chromium and chromedriver (scripts/setup.sh installs them)";
  }
  Dir dir;
  const std::string db = "sqlite:///" + dir.path + "/s.db";
  const std::string name = "<script>alert(1)</script>";
  one_trial_study(dir, db, name);
  Served served(db);
  Browser browser(driver, dir.path);
  for (const std::string page : {"/", "/study?name=%3Cscript%3Ealert(1)%3C%2Fscript%3E"}) {
    browser.open(served.url(page));
    EXPECT_TRUE(browser.wait_for_text(name, 10)) << page << ": " << browser.text();
    std::this_thread::sleep_for(std::chrono::milliseconds(800));  // a refresh or two
    EXPECT_FALSE(browser.alert_open()) << page;
    EXPECT_EQ(browser.run("return document.scripts.length;").get<int>(), 1) << page;
    EXPECT_NE(browser.text().find(name), std::string::npos) << page;
  }
}

TEST(TuneServe, UnknownPathsAre404AndABrokenStorage503) {
  Dir dir;
  const std::string file = dir.path + "/s.db";
  one_trial_study(dir, file, "s");
  const auto before = std::filesystem::last_write_time(file);
  Served served(file);
  httplib::Client c("127.0.0.1", served.dashboard.port());
  auto ok = c.Get("/study?name=s");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200);
  EXPECT_NE(ok->body.find("COMPLETE"), std::string::npos);
  EXPECT_NE(ok->get_header_value("Content-Security-Policy").find("script-src 'self'"),
            std::string::npos);
  EXPECT_NE(ok->body.find("data-refresh-ms=\"300\""), std::string::npos) << "--refresh 0.3";
  for (const char* path : {"/nope", "/study?name=other", "/fragment/nope", "/study/../s.db"}) {
    auto r = c.Get(path);
    ASSERT_TRUE(r) << path;
    EXPECT_EQ(r->status, 404) << path << ": " << r->body;
  }
  auto post = c.Post("/study?name=s", "x", "text/plain");
  ASSERT_TRUE(post);
  EXPECT_EQ(post->status, 405);
  EXPECT_EQ(std::filesystem::last_write_time(file), before) << "a request changed the storage";
  std::ofstream(file, std::ios::trunc) << "this is not a database, not even SQLite's header";
  auto broken = c.Get("/");
  ASSERT_TRUE(broken);
  EXPECT_EQ(broken->status, 503);
  EXPECT_EQ(broken->body.find("storage unavailable: "), 0u) << broken->body;
  EXPECT_EQ(std::count(broken->body.begin(), broken->body.end(), '\n'), 1) << broken->body;
}

TEST(TuneServe, BadInputIsOneLine) {
  Dir dir;
  const std::string db = dir.path + "/s.db";
  one_trial_study(dir, db, "s");
  // A port in use (by a listener without SO_REUSEPORT, or by another dashboard).
  Served first(db);
  const std::string port = std::to_string(first.dashboard.port());
  const auto busy = testing::run_process(
      {testing::cli_path(), "tune", "serve", "--storage", db, "--port", port}, {}, 30);
  EXPECT_NE(busy.exit_code, 0);
  EXPECT_NE(busy.output.find("cannot listen on 127.0.0.1:" + port + ": Address already in use"),
            std::string::npos)
      << busy.output;
  for (const std::string& url : {"sqlite:///" + dir.path + "/missing.db",
                                 std::string("postgresql://nobody@127.0.0.1:1/x")}) {
    const auto r = testing::run_process(
        {testing::cli_path(), "tune", "serve", "--storage", url, "--port", "0"}, {}, 30);
    EXPECT_NE(r.exit_code, 0) << url;
    EXPECT_NE(r.output.find("paratrain tune: error: tune storage: "), std::string::npos)
        << r.output;
    EXPECT_TRUE(r.output.find("cannot open SQLite database") != std::string::npos ||
                r.output.find("cannot connect to PostgreSQL") != std::string::npos ||
                r.output.find("built without libpq") != std::string::npos)
        << r.output;
    EXPECT_FALSE(std::filesystem::exists(dir.path + "/missing.db")) << "serve created a file";
  }
  // Another address than loopback: a warning, and it serves; SIGTERM stops it cleanly.
  auto wide = testing::start_process(
      {testing::cli_path(), "tune", "serve", "--storage", db, "--bind", "0.0.0.0", "--port", "0"});
  EXPECT_TRUE(wide.wait_for_output("http://0.0.0.0:", 20)) << wide.output;
  EXPECT_NE(wide.output.find("warning: listening on 0.0.0.0, not loopback"), std::string::npos)
      << wide.output;
  ::kill(wide.pid, SIGTERM);
  const auto stopped = wide.finish(20);
  EXPECT_EQ(stopped.exit_code, 0) << "signal " << stopped.signal << ": " << stopped.output;
}

// DNS rebinding: a page of another site whose name resolves to 127.0.0.1 sends its own name as
// Host. Only exact loopback names and addresses, with this server's port, are served; names that
// merely start like a loopback address, the numeric shorthands a resolver also reads (browsers
// send the dotted quad for those), and other ports are refused.
TEST(TuneServe, HostMustNameLoopbackAndThisPort) {
  Dir dir;
  const std::string file = dir.path + "/s.db";
  one_trial_study(dir, file, "s");
  Served served(file);
  const std::string port = std::to_string(served.dashboard.port());
  httplib::Client c("127.0.0.1", served.dashboard.port());
  for (const std::string& host : std::vector<std::string>{
           "127.0.0.1:" + port, "localhost:" + port, "LocalHost:" + port, "127.0.0.2:" + port,
           "[::1]:" + port, "[0:0:0:0:0:0:0:1]:" + port, "[::ffff:127.0.0.1]:" + port}) {
    auto r = c.Get("/", {{"Host", host}});
    ASSERT_TRUE(r) << host;
    EXPECT_EQ(r->status, 200) << host;
  }
  for (const std::string& host : std::vector<std::string>{
           "evil.example:" + port, "127.0.0.1.evil.example:" + port, "127.evil.example:" + port,
           "localhost.evil.example:" + port, "127.0.0.1.:" + port, "127.1:" + port,
           "2130706433:" + port, "0x7f.0.0.1:" + port, "0177.0.0.1:" + port, "[::2]:" + port,
           "::1:" + port, "[::1:" + port, "127.0.0.1:" + port + "0", "127.0.0.1:1" + port,
           "127.0.0.1:", "127.0.0.1:+" + port, "[::1]:80", "localhost", "127.0.0.1"}) {
    auto r = c.Get("/", {{"Host", host}});
    ASSERT_TRUE(r) << host;
    EXPECT_EQ(r->status, 403) << host;
    EXPECT_NE(r->body.find("open it as http://127.0.0.1:" + port + "/"), std::string::npos)
        << r->body;
  }
  EXPECT_TRUE(loopback_address("127.0.0.1"));
  EXPECT_TRUE(loopback_address("::1"));
  EXPECT_FALSE(loopback_address("127.0.0.1.evil.example"));
  EXPECT_FALSE(loopback_address("0.0.0.0"));
  // Where it listens is resolved, in any form the resolver reads.
  EXPECT_TRUE(binds_loopback_only("127.1"));
  EXPECT_TRUE(binds_loopback_only("localhost"));
  EXPECT_TRUE(binds_loopback_only("::1"));
  EXPECT_FALSE(binds_loopback_only("0.0.0.0"));
}

// A TCP connection to the dashboard's port that sends nothing: returns its descriptor.
int idle_connection(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0) << std::strerror(errno);
  return fd;
}

// Whether the server closed `fd` within `seconds` (a read sees the end, after an error page the
// server may answer a request it cut short with).
bool closed_by_server(int fd, double seconds) {
  timeval tv{static_cast<time_t>(seconds),
             static_cast<suseconds_t>((seconds - static_cast<time_t>(seconds)) * 1e6)};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char buf[4096];
  for (;;) {  // an answer (an error page) may come first
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) {
      return n == 0 || errno == ECONNRESET;
    }
  }
}

// Connections that send no request (or never finish one) cannot hold the dashboard: a normal
// request is answered at once beside 20 of them, each is closed after the request timeout, and
// beyond max_connections the oldest are closed at once.
TEST(TuneServe, IdleConnectionsDoNotStallRequests) {
  Dir dir;
  const std::string file = dir.path + "/s.db";
  one_trial_study(dir, file, "s");
  {
    Dashboard dashboard(DashboardOptions().storage(file).port(0).request_timeout_seconds(2));
    std::thread serving([&] { dashboard.run(); });
    std::vector<int> idle;
    for (int i = 0; i < 20; ++i) {
      idle.push_back(idle_connection(dashboard.port()));
    }
    const int slow = idle_connection(dashboard.port());
    ASSERT_EQ(::send(slow, "GET / HTTP/1.1\r\n", 16, 0), 16);  // a request that never ends
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const auto start = std::chrono::steady_clock::now();
    httplib::Client c("127.0.0.1", dashboard.port());
    auto r = c.Get("/study?name=s");
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200);
    EXPECT_LT(seconds, 1.0) << "a request waited behind connections that sent nothing";
    idle.push_back(slow);
    for (size_t i = 0; i < idle.size(); ++i) {
      EXPECT_TRUE(closed_by_server(idle[i], 5))
          << "connection " << i << " of " << idle.size() << " was kept without a request";
      ::close(idle[i]);
    }
    dashboard.stop();
    serving.join();
  }
  Dashboard dashboard(
      DashboardOptions().storage(file).port(0).request_timeout_seconds(60).max_connections(8));
  std::thread serving([&] { dashboard.run(); });
  std::vector<int> idle;
  for (int i = 0; i < 20; ++i) {
    idle.push_back(idle_connection(dashboard.port()));
  }
  // 12 of them go within a second or so (the oldest, as the server saw them arrive); 8 stay,
  // their timeout being a minute.
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  int closed = 0;
  for (const int fd : idle) {
    closed += closed_by_server(fd, 0.05) ? 1 : 0;
  }
  EXPECT_EQ(closed, 12);
  httplib::Client c("127.0.0.1", dashboard.port());
  auto r = c.Get("/");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  for (const int fd : idle) {
    ::close(fd);
  }
  dashboard.stop();
  serving.join();
  EXPECT_NE(testing::error_of([&] {
              Dashboard d(DashboardOptions().storage(file).max_connections(0));
            }).find("max_connections must be 1 to 4096, got 0"),
            std::string::npos);
  EXPECT_NE(testing::error_of([&] {
              Dashboard d(DashboardOptions().storage(file).request_timeout_seconds(0));
            }).find("the request timeout must be > 0 seconds, got 0"),
            std::string::npos);
}

}  // namespace dashboard_tests
}  // namespace tune
}  // namespace paratrain
