// paratrain tune serve (dashboard.h) on Debian's cpp-httplib. Pages are the report's HTML
// (report.h); a small script of our own fetches a fresh fragment every few seconds and swaps it
// in, which keeps the reader's scroll position where a reload would not.

#include "paratrain/tune/dashboard.h"

#include "paratrain/tune/report.h"
#include "paratrain/tune/storage.h"

#include <c10/util/Exception.h>

#ifdef PARATRAIN_WITH_DASHBOARD
#include <httplib.h>
#include <sys/socket.h>
#endif

#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace paratrain {
namespace tune {

bool loopback_address(const std::string& host) {
  std::string h;
  for (char c : host) {
    h += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  return h.rfind("127.", 0) == 0 || h == "localhost" || h == "::1" || h == "[::1]";
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
  // site that resolved its own name to 127.0.0.1 (DNS rebinding) is refused by its Host header.
  httplib::Server::HandlerResponse screen(const httplib::Request& req, httplib::Response& res) {
    if (req.method != "GET" && req.method != "HEAD") {
      res.status = 405;
      res.set_content("the dashboard is read-only: " + req.method + " is not served\n",
                      "text/plain; charset=utf-8");
      return httplib::Server::HandlerResponse::Handled;
    }
    const std::string host = req.get_header_value("Host");  // browsers always send one
    const std::string name = !host.empty() && host[0] == '[' ? host.substr(0, host.find(']') + 1)
                                                             : host.substr(0, host.find(':'));
    if (loopback_address(o.bind()) && !host.empty() && !loopback_address(name)) {
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
  auto storage = open_storage(options.storage(), true);  // throws one line when unreachable
  storage->list_studies();
  impl_->shown_storage = storage->url();
  impl_->routes();
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
  const bool served = impl_->stop_asked || impl_->server.listen_after_bind();
  const int err = errno;
  impl_->running = false;
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
