// paratrain tune serve (dashboard.h) on Debian's cpp-httplib. Pages are the report's HTML
// (report.h); a small script of our own fetches a fresh fragment every few seconds and swaps it
// in, which keeps the reader's scroll position where a reload would not.

#include "paratrain/tune/dashboard.h"

#include "paratrain/tune/report.h"
#include "paratrain/tune/storage.h"

#include <c10/util/Exception.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#ifdef PARATRAIN_WITH_DASHBOARD
#include <dirent.h>
#include <httplib.h>
#endif

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

namespace paratrain {
namespace tune {

// Exact names and literals only: "localhost", a dotted-quad address in 127.0.0.0/8, ::1 or an
// IPv4-mapped 127.x (bracketed or not). Not a name that merely starts with "127." (a domain such as
// 127.0.0.1.example.com resolves wherever its owner likes), and not the shorthands inet_aton also
// reads (127.1, 2130706433, 0x7f.1): browsers and curl send the dotted quad for those.
bool loopback_address(const std::string& host) {
  std::string h;
  for (char c : host) {
    h += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  if (h == "localhost") {
    return true;
  }
  if (h.size() > 2 && h.front() == '[' && h.back() == ']') {
    h = h.substr(1, h.size() - 2);
  }
  in_addr v4{};
  if (inet_pton(AF_INET, h.c_str(), &v4) == 1) {
    return (ntohl(v4.s_addr) >> 24) == 127;
  }
  in6_addr v6{};
  if (inet_pton(AF_INET6, h.c_str(), &v6) == 1) {
    return IN6_IS_ADDR_LOOPBACK(&v6) || (IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127);
  }
  return false;
}

bool binds_loopback_only(const std::string& bind) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(bind.c_str(), nullptr, &hints, &found) != 0) {
    return false;
  }
  bool loopback = found != nullptr;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      const auto* v4 = reinterpret_cast<const sockaddr_in*>(a->ai_addr);
      loopback = loopback && (ntohl(v4->sin_addr.s_addr) >> 24) == 127;
    } else if (a->ai_family == AF_INET6) {
      const in6_addr& v6 = reinterpret_cast<const sockaddr_in6*>(a->ai_addr)->sin6_addr;
      loopback = loopback && (IN6_IS_ADDR_LOOPBACK(&v6) ||
                              (IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127));
    } else {
      loopback = false;
    }
  }
  freeaddrinfo(found);
  return loopback;
}

#ifndef PARATRAIN_WITH_DASHBOARD
struct Dashboard::Impl {};
Dashboard::Dashboard(const DashboardOptions&) {
  TORCH_CHECK(false,
              "tune serve: this paratrain was built without cpp-httplib (install "
              "libcpp-httplib-dev and rebuild)");
}
Dashboard::~Dashboard() = default;
int Dashboard::port() const {
  return 0;
}
const std::string& Dashboard::storage_url() const {
  static const std::string none;
  return none;
}
void Dashboard::run() {}
void Dashboard::stop() {}
bool dashboard_available() {
  return false;
}
#else
namespace {

// The page's only script: every `refresh` ms, fetch the fragment at the page's own path under
// /fragment (with its query) and swap it in; a failure shows the server's one line.
const char* const kScript =
    "(function(){\n"
    "  var box = document.getElementById('content');\n"
    "  var status = document.getElementById('status');\n"
    "  var every = Number(document.body.getAttribute('data-refresh-ms')) || 2000;\n"
    "  var url = '/fragment' + location.pathname + location.search;\n"
    "  function tick() {\n"
    "    fetch(url, {cache: 'no-store'}).then(function(r) {\n"
    "      return r.text().then(function(t) {\n"
    "        if (r.ok) { box.innerHTML = t; status.textContent = 'updated ' +\n"
    "            new Date().toLocaleTimeString(); }\n"
    "        else { status.textContent = t; }\n"
    "      });\n"
    "    }).catch(function(e) { status.textContent = 'the server is not answering: ' + e; })\n"
    "      .then(function() { setTimeout(tick, every); });\n"
    "  }\n"
    "  setTimeout(tick, every);\n"
    "})();\n";

// No script but /dashboard.js, no requests but to this server, nothing framed: a study string
// that escaped escaping still could not run.
const char* const kPolicy =
    "default-src 'none'; script-src 'self'; connect-src 'self'; style-src 'unsafe-inline'; "
    "img-src 'self' data:; frame-ancestors 'none'";

std::string percent_encode(const std::string& s) {
  std::ostringstream out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out << c;
    } else {
      char buf[4];
      std::snprintf(buf, sizeof(buf), "%%%02X", c);
      out << buf;
    }
  }
  return out.str();
}

struct NotFound : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::string studies_fragment(Storage& storage) {
  std::ostringstream out;
  const auto studies = storage.list_studies();
  out << "<h1>Studies in " << html_escape(storage.url()) << "</h1>\n";
  if (studies.empty()) {
    out << "<p>No study yet.</p>\n";
  }
  out << "<table><tr><th>study</th><th>metric</th><th>trials</th><th>states</th></tr>\n";
  for (const auto& s : studies) {
    storage.load_study(s.name);
    std::map<std::string, int> states;
    const auto trials = storage.load_trials();
    for (const auto& t : trials) {
      ++states[to_string(t.state)];
    }
    std::string counts;
    for (const auto& [state, n] : states) {
      counts += (counts.empty() ? "" : ", ") + std::to_string(n) + " " + state;
    }
    out << "<tr><td><a href=\"/study?name=" << html_escape(percent_encode(s.name)) << "\">"
        << html_escape(s.name) << "</a></td><td>" << html_escape(s.mode) << " "
        << html_escape(s.metric) << "</td><td>" << trials.size() << "</td><td>" << counts
        << "</td></tr>\n";
  }
  out << "</table>\n";
  return out.str();
}

std::string study_fragment(Storage& storage, const std::string& name) {
  bool known = false;
  for (const auto& s : storage.list_studies()) {
    known = known || s.name == name;
  }
  if (!known) {
    throw NotFound("no study '" + name + "' in " + storage.url());
  }
  const StudySpec spec = storage.load_study(name);
  return "<p><a href=\"/\">all studies</a></p>\n" +
         html_report_body(spec, storage.load_trials(), storage.load_exploits());
}

}  // namespace

// Named, not anonymous: Dashboard::Impl holds one, and a class of a header must not hold a type
// of an anonymous namespace (GCC's -Wsubobject-linkage, in a unity batch).
namespace dashboard_internal {

// Note [Connections the dashboard holds]
// cpp-httplib (0.11) gives each connection a pool thread until it has read a request, with a
// per-read timeout only: a client that connects and sends nothing, or one byte now and then,
// holds a thread, and 20 of them kept a normal request waiting for 20 s. httplib has no hook
// that sees a connection before its request, so this guard finds the server's connections
// itself (the process's sockets whose local port is the dashboard's), and shuts down each one
// that has not sent a whole request within `request_timeout`, or that comes beyond
// `max_connections` (the oldest first): its thread then reads end-of-file and moves on. A
// connection counts as served once its request reaches the router (served()). Each connection
// serves one request (no keep-alive), so a served one is busy answering, never idle.
class ConnectionGuard {
 public:
  ConnectionGuard(int port, std::chrono::milliseconds request_timeout, size_t max_connections)
      : port_(port), timeout_(request_timeout), max_(max_connections) {}
  ~ConnectionGuard() { stop(); }

  void start() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = false;
    }
    thread_ = std::thread([this] {
      std::unique_lock<std::mutex> lock(mutex_);
      while (!stopping_) {
        lock.unlock();
        scan();
        lock.lock();
        wake_.wait_for(lock, std::chrono::milliseconds(100), [this] { return stopping_; });
      }
    });
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) {
      thread_.join();
    }
  }

  /// A request from `peer` ("address:port") reached the router.
  void served(const std::string& peer) {
    std::lock_guard<std::mutex> lock(mutex_);
    served_[peer] = std::chrono::steady_clock::now();
  }

 private:
  struct Seen {
    std::string peer;
    std::chrono::steady_clock::time_point since;
  };

  void scan();

  const int port_;
  const std::chrono::milliseconds timeout_;
  const size_t max_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::map<std::string, std::chrono::steady_clock::time_point> served_;  // request arrived
  std::map<int, Seen> seen_;  // only the scanning thread touches it
  std::thread thread_;
};

// The peer ("address:port", as httplib's Request::remote_addr and remote_port give it) of `fd`
// when it is a connected TCP socket whose own port is `port`; "" otherwise (the listening socket
// has no peer; this process's own clients of the dashboard have another local port).
static std::string connection_peer(int fd, int port) {
  sockaddr_storage local{};
  socklen_t n = sizeof(local);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &n) != 0) {
    return "";
  }
  int local_port = -1;
  if (local.ss_family == AF_INET) {
    local_port = ntohs(reinterpret_cast<const sockaddr_in*>(&local)->sin_port);
  } else if (local.ss_family == AF_INET6) {
    local_port = ntohs(reinterpret_cast<const sockaddr_in6*>(&local)->sin6_port);
  }
  sockaddr_storage peer{};
  n = sizeof(peer);
  if (local_port != port || getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &n) != 0) {
    return "";
  }
  char address[NI_MAXHOST];
  char service[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&peer), n, address, sizeof(address), service,
                  sizeof(service), NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return "";
  }
  return std::string(address) + ":" + service;
}

void ConnectionGuard::scan() {
  using Clock = std::chrono::steady_clock;
  const auto now = Clock::now();
  std::map<int, Seen> current;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) {
    return;  // no /proc: httplib's own per-read timeout still applies
  }
  while (const dirent* e = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == dirfd(dir)) {
      continue;
    }
    const std::string peer = connection_peer(static_cast<int>(fd), port_);
    if (peer.empty()) {
      continue;
    }
    const auto it = seen_.find(static_cast<int>(fd));
    current[static_cast<int>(fd)] =
        it != seen_.end() && it->second.peer == peer ? it->second : Seen{peer, now};
  }
  closedir(dir);
  seen_ = std::move(current);
  std::vector<std::pair<Clock::time_point, int> > waiting;  // no request yet, oldest first
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::set<std::string> live;
    for (const auto& [fd, s] : seen_) {
      live.insert(s.peer);
    }
    // A request may arrive before a scan sees its connection: forget a served peer only once
    // its connection has been gone for a while.
    for (auto it = served_.begin(); it != served_.end();) {
      it = !live.count(it->first) && now - it->second > std::chrono::seconds(2) ? served_.erase(it)
                                                                                : std::next(it);
    }
    for (const auto& [fd, s] : seen_) {
      if (!served_.count(s.peer)) {
        waiting.emplace_back(s.since, fd);
      }
    }
  }
  std::sort(waiting.begin(), waiting.end());
  size_t held = seen_.size();
  for (const auto& [since, fd] : waiting) {
    if (now - since < timeout_ && held <= max_) {
      continue;
    }
    // Shut down, not closed: httplib's thread still owns the descriptor and closes it. The peer
    // is read again first: a descriptor closed and reused since the scan is another connection
    // (only one of this server's own, with the same peer, could pass, in the instant between).
    if (connection_peer(fd, port_) == seen_[fd].peer && ::shutdown(fd, SHUT_RDWR) == 0) {
      --held;
    }
  }
}

}  // namespace dashboard_internal

namespace {

// Whether a Host header ("name" or "name:port") names this server on loopback: a loopback name or
// address (loopback_address) and the port it serves (80 when the header gives none).
bool names_this_loopback_server(const std::string& host, int port) {
  size_t name_end = host.find(host[0] == '[' ? ']' : ':');
  if (host[0] == '[') {
    if (name_end == std::string::npos) {
      return false;
    }
    ++name_end;
  }
  const std::string rest = name_end == std::string::npos ? "" : host.substr(name_end);
  int given = 80;
  if (!rest.empty()) {
    if (rest[0] != ':' || rest.size() < 2 || rest.size() > 6 ||
        rest.find_first_not_of("0123456789", 1) != std::string::npos) {
      return false;
    }
    given = std::stoi(rest.substr(1));
  }
  return given == port && loopback_address(host.substr(0, name_end));
}

// The first line of an error, for a one-line 503.
std::string first_line(const std::string& what) {
  return what.substr(0, what.find('\n'));
}

}  // namespace

struct Dashboard::Impl {
  DashboardOptions o;
  std::string shown_storage;  // its URL as storage shows it (a password hidden)
  httplib::Server server;
  int port = 0;
  std::unique_ptr<dashboard_internal::ConnectionGuard> guard;  // made once the port is bound
  bool on_loopback = true;                                     // binds_loopback_only(o.bind())
  std::atomic<bool> running{false}, stop_asked{false};

  // A fresh read-only connection per request: a storage that comes back after an outage is
  // seen again, and no request can change it.
  std::string fragment(const httplib::Request& req, const std::string& path) {
    auto storage = open_storage(o.storage(), true);
    if (path == "/") {
      return studies_fragment(*storage);
    }
    if (path == "/study" && req.has_param("name")) {
      return study_fragment(*storage, req.get_param_value("name"));
    }
    throw NotFound("no page " + path);
  }

  void answer(const httplib::Request& req,
              httplib::Response& res,
              const std::string& path,
              bool whole) {
    try {
      const std::string body = fragment(req, path);
      const std::string head = "<script src=\"/dashboard.js\" defer></script>";
      const std::string page = "<p id=\"status\"></p><div id=\"content\">" + body + "</div>";
      std::string html = whole ? html_page("paratrain tune serve", page, head) : body;
      const size_t at = html.find("<body>");
      if (whole && at != std::string::npos) {  // the script's refresh period
        const double ms = std::min(o.refresh_seconds(), 86400.0) * 1000;
        html.replace(at, 6,
                     "<body data-refresh-ms=\"" + std::to_string(static_cast<int64_t>(ms)) + "\">");
      }
      res.set_content(html, "text/html; charset=utf-8");
    } catch (const NotFound& e) {  // plain text: nothing to escape
      res.status = 404;
      res.set_content(std::string(e.what()) + "\n", "text/plain; charset=utf-8");
    } catch (const std::exception& e) {
      res.status = 503;
      res.set_content("storage unavailable: " + first_line(e.what()) + "\n",
                      "text/plain; charset=utf-8");
    }
  }

  // Only GET (and HEAD) are served: nothing changes the storage. On loopback, a page of another
  // site that resolved its own name to 127.0.0.1 (DNS rebinding) is refused by its Host header,
  // which must name loopback and this port exactly.
  httplib::Server::HandlerResponse screen(const httplib::Request& req, httplib::Response& res) {
    guard->served(req.remote_addr + ":" + std::to_string(req.remote_port));
    if (req.method != "GET" && req.method != "HEAD") {
      res.status = 405;
      res.set_content("the dashboard is read-only: " + req.method + " is not served\n",
                      "text/plain; charset=utf-8");
      return httplib::Server::HandlerResponse::Handled;
    }
    const std::string host = req.get_header_value("Host");  // browsers always send one
    if (on_loopback && !host.empty() && !names_this_loopback_server(host, port)) {
      res.status = 403;
      res.set_content("the dashboard listens on loopback: open it as http://127.0.0.1:" +
                          std::to_string(port) + "/\n",
                      "text/plain; charset=utf-8");
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  }

  void routes() {
    server.set_pre_routing_handler(
        [this](const httplib::Request& req, httplib::Response& res) { return screen(req, res); });
    server.set_default_headers({{"Content-Security-Policy", kPolicy},
                                {"X-Content-Type-Options", "nosniff"},
                                {"Cache-Control", "no-store"}});
    for (const std::string path : {"/", "/study"}) {
      server.Get(path, [this, path](const httplib::Request& req, httplib::Response& res) {
        answer(req, res, path, true);
      });
      server.Get("/fragment" + std::string(path == "/" ? "/" : path),
                 [this, path](const httplib::Request& req, httplib::Response& res) {
                   answer(req, res, path, false);
                 });
    }
    server.Get(R"(/dashboard\.js)", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(kScript, "text/javascript; charset=utf-8");
    });
    server.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
      if (res.body.empty()) {
        res.set_content(
            res.status == 404 ? "no page " + html_escape(req.path) + "\n" : "request refused\n",
            "text/plain; charset=utf-8");
      }
    });
  }
};

Dashboard::Dashboard(const DashboardOptions& options) : impl_(std::make_unique<Impl>()) {
  impl_->o = options;
  TORCH_CHECK(options.refresh_seconds() > 0, "tune serve: the refresh period must be > 0, got ",
              options.refresh_seconds());
  TORCH_CHECK(options.port() >= 0 && options.port() <= 65535,
              "tune serve: --port must be 0 to 65535, got ", options.port());
  TORCH_CHECK(options.request_timeout_seconds() > 0,
              "tune serve: the request timeout must be > 0 seconds, got ",
              options.request_timeout_seconds());
  TORCH_CHECK(options.max_connections() >= 1 && options.max_connections() <= 4096,
              "tune serve: max_connections must be 1 to 4096, got ", options.max_connections());
  auto storage = open_storage(options.storage(), true);  // throws one line when unreachable
  storage->list_studies();
  impl_->shown_storage = storage->url();
  impl_->routes();
  // One thread per connection held (ConnectionGuard bounds them), one request per connection,
  // and no read may wait longer than a whole request may take.
  const size_t threads = static_cast<size_t>(options.max_connections());
  impl_->server.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  impl_->server.set_keep_alive_max_count(1);
  impl_->server.set_read_timeout(
      std::chrono::milliseconds(static_cast<int64_t>(options.request_timeout_seconds() * 1000)));
  // httplib also waits this long for a connection's first byte (5 s by default).
  impl_->server.set_keep_alive_timeout(
      static_cast<time_t>(std::ceil(options.request_timeout_seconds())));
  impl_->on_loopback = binds_loopback_only(options.bind());
  // SO_REUSEADDR only: httplib's default adds SO_REUSEPORT, with which a second server binds
  // a port already in use and the two share its requests.
  impl_->server.set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  const std::string& host = options.bind();
  errno = 0;
  if (options.port() == 0) {
    impl_->port = impl_->server.bind_to_any_port(host);
  } else if (impl_->server.bind_to_port(host, options.port())) {
    impl_->port = options.port();
  }
  const int err = errno;
  TORCH_CHECK(impl_->port > 0, "tune serve: cannot listen on ", host, ":", options.port(), ": ",
              err != 0 ? std::strerror(err) : "the address cannot be bound",
              " (choose another --port or --bind)");
  impl_->guard = std::make_unique<dashboard_internal::ConnectionGuard>(
      impl_->port,
      std::chrono::milliseconds(static_cast<int64_t>(options.request_timeout_seconds() * 1000)),
      static_cast<size_t>(options.max_connections()));
}

Dashboard::~Dashboard() {
  stop();
}

int Dashboard::port() const {
  return impl_->port;
}

const std::string& Dashboard::storage_url() const {
  return impl_->shown_storage;
}

void Dashboard::run() {
  impl_->running = true;
  struct Running {  // also when starting a thread throws: stop() would wait for the loop
    Impl& impl;
    ~Running() {
      impl.guard->stop();
      impl.running = false;
    }
  } running{*impl_};
  // Started here, as httplib's threads are: a caller that blocks signals before run() (to take
  // them on a thread of its own) blocks them in every thread of the server.
  impl_->guard->start();
  const bool served = impl_->stop_asked || impl_->server.listen_after_bind();
  const int err = errno;
  // httplib leaves its loop by itself only when accept() fails for good (out of memory or
  // descriptors).
  TORCH_CHECK(served || impl_->stop_asked,
              "tune serve: the server stopped accepting connections on ", impl_->o.bind(), ":",
              impl_->port, " (", std::strerror(err), ")");
}

// httplib's stop() does nothing until its loop runs: a stop that comes while run() is starting
// waits for the loop (a signal right after start-up would be lost otherwise).
void Dashboard::stop() {
  impl_->stop_asked = true;
  while (impl_->running && !impl_->server.is_running()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  impl_->server.stop();
}

bool dashboard_available() {
  return true;
}
#endif

}  // namespace tune
}  // namespace paratrain
