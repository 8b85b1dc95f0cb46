#pragma once

// `paratrain tune serve`: a read-only web view of a study storage while tuners write to it, as
// Ray's dashboard or optuna-dashboard: the studies; each study's history and intermediate curves,
// its population-based training lineage, its parameters and its table of trials (the report's,
// report.h), refreshed in place every few seconds without reloading the page.
//
// Every request opens the storage read-only and only reads; every string from a study is
// HTML-escaped, and the pages run no script but the dashboard's own (a Content-Security-Policy
// says so to the browser). An unknown path is a 404; a storage that cannot be read answers 503
// with one line. Available where cpp-httplib was found at build time (PARATRAIN_WITH_DASHBOARD).

#include <torch/arg.h>

#include <memory>
#include <string>

namespace paratrain {
namespace tune {

struct DashboardOptions {
  /// The storage URL, as the tuner's --storage.
  TORCH_ARG(std::string, storage) = "";
  /// The address to listen on: loopback unless another is given.
  TORCH_ARG(std::string, bind) = "127.0.0.1";
  /// 0: a free port (port() tells which).
  TORCH_ARG(int, port) = 8080;
  /// How often an open page asks for fresh content.
  TORCH_ARG(double, refresh_seconds) = 2;
  /// How long a connection may take to send its whole request before it is closed.
  TORCH_ARG(double, request_timeout_seconds) = 5;
  /// The connections held at once (each has a thread); beyond them, the oldest that has not yet
  /// sent its request is closed.
  TORCH_ARG(int, max_connections) = 64;
};

class Dashboard {
 public:
  /// Checks that the storage can be read and binds the port. Throws c10::Error with one line for
  /// a storage that cannot be opened and for an address or port that cannot be bound (one in
  /// use).
  explicit Dashboard(const DashboardOptions& options);
  ~Dashboard();
  Dashboard(const Dashboard&) = delete;
  Dashboard& operator=(const Dashboard&) = delete;

  int port() const;
  /// The storage's URL as it is shown (a password hidden).
  const std::string& storage_url() const;
  /// Serves until stop() (from another thread; a stop before or while run() starts counts too).
  /// Throws c10::Error when the server stops by itself (accept() failing for good).
  void run();
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Whether `host`, as a browser's Host header gives it, names the loopback interface: exactly
/// "localhost" (any case), a dotted-quad address in 127.0.0.0/8, or ::1 (also bracketed, and
/// IPv4-mapped 127.x). Never resolved: not a name that starts with "127." but is a domain.
bool loopback_address(const std::string& host);

/// Whether the address `bind` (a name, or an address in any form the resolver reads: 127.1,
/// ip6-localhost) resolves only to loopback addresses, where the dashboard is reachable from this
/// machine only.
bool binds_loopback_only(const std::string& bind);

/// Whether this build has the dashboard (cpp-httplib).
bool dashboard_available();

}  // namespace tune
}  // namespace paratrain
