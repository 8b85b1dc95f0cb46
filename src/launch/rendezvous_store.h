#pragma once

// Internal: where the launchers of a job keep their rendezvous (rendezvous.h). Two kinds:
// paratrain's socket store, served by one of the launchers (--rdzv-backend c10d, and the static
// rendezvous' restarts), and etcd, a server of its own that outlives any node (--rdzv-backend
// etcd). Both give the same operations with c10d's Store semantics, on text values.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace paratrain {
namespace dist {
namespace detail {

class RendezvousStore {
 public:
  virtual ~RendezvousStore() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  /// c10d's compareSet: sets `desired` when the key holds `expected` (or is absent and `expected`
  /// is empty), and returns what the key holds afterwards.
  virtual std::string compare_set(const std::string& key,
                                  const std::string& expected,
                                  const std::string& desired) = 0;
  /// The value, nullopt when the key is absent.
  virtual std::optional<std::string> get(const std::string& key) = 0;
  /// Adds `delta` to the decimal number the key holds (0 when absent); returns the sum.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  bool check(const std::string& key) { return get(key).has_value(); }
  /// A set whose key lives as long as this client's connection (SocketStore::setEphemeral). A
  /// store without such keys (etcd here) keeps it as a plain set: ephemeral_kept() says so.
  virtual void set_ephemeral(const std::string& key, const std::string& value) { set(key, value); }
  virtual bool ephemeral_kept() const { return false; }
  /// Whether the last call failed because the server could not be reached in time (a partition,
  /// a host that stopped), rather than because no server is there any more, or not at all.
  virtual bool last_call_unreachable() const { return false; }
  /// Whether the last call failed because no server is there any more (refused, closed).
  virtual bool last_call_found_none() const { return false; }
};

/// paratrain's socket store at host:port, served by this process when `serve` (throws c10::Error
/// as SocketStore does). `call_timeout` bounds each call once connected.
std::unique_ptr<RendezvousStore> open_socket_store(const std::string& host,
                                                   int port,
                                                   bool serve,
                                                   std::chrono::milliseconds connect_timeout,
                                                   std::chrono::milliseconds call_timeout);

/// etcd's v3 API (its JSON gateway) at host:port. Connects within `connect_timeout` and checks
/// that an etcd answers there; throws c10::Error with one line otherwise (nothing listens, or
/// something other than etcd answers), or when this build has no HTTP client (cpp-httplib).
std::unique_ptr<RendezvousStore> open_etcd_store(const std::string& host,
                                                 int port,
                                                 std::chrono::milliseconds connect_timeout,
                                                 std::chrono::milliseconds call_timeout);

}  // namespace detail
}  // namespace dist
}  // namespace paratrain
