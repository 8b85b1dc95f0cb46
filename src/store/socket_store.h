#pragma once

// Internal: paratrain's key-value store over TCP, which the launcher's rendezvous uses, and which
// Gloo and NCCL use through its c10d::Store face (c10d_socket_store.h) as they would c10d's
// TCPStore. It needs no libtorch (only c10's errors), so that `paratrain launch` starts without
// loading libtorch (about a CPU-second per process).
//
// Why not c10d's TCPStore: its server in libtorch 1.13 listens on every address of the host
// (getaddrinfo(nullptr, AI_PASSIVE)); 2.x can be told otherwise only by handing it a socket, and
// 1.13 not at all. A job must serve its store and its rendezvous only where --master-addr says, and
// a one-node job on loopback only. This store binds exactly the addresses its host name resolves
// to, on both libtorch versions. Every call also has a deadline (TCPStore's add, set and check wait
// forever on a peer that stopped answering), and a timed-out connection is never reused.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace paratrain {
namespace dist {
namespace detail {

class StoreServer;

/// Waits without end (c10d's kNoTimeout).
constexpr std::chrono::milliseconds kNoStoreTimeout{0};

/// A client of the store at host:port; with `serve`, also its server, which lives as long as this
/// object. The server binds every address `host` resolves to (port 0: a free port, see port()).
/// A client retries connecting until `timeout`. Every call waits at most the store's timeout
/// (setTimeout; get and wait count it while the key is missing); kNoStoreTimeout waits without
/// end. The calls are c10d::Store's, with its names and semantics. Thread-safe: calls on one
/// object are serialised.
class SocketStore {
 public:
  SocketStore(std::string host, int port, bool serve, std::chrono::milliseconds timeout);
  ~SocketStore();
  SocketStore(const SocketStore&) = delete;
  SocketStore& operator=(const SocketStore&) = delete;

  /// The port served or connected to.
  int port() const { return port_; }

  std::chrono::milliseconds getTimeout() const { return std::chrono::milliseconds(timeout_ms_); }
  void setTimeout(std::chrono::milliseconds timeout) { timeout_ms_ = timeout.count(); }

  void set(const std::string& key, const std::vector<uint8_t>& value);
  std::vector<uint8_t> compareSet(const std::string& key,
                                  const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired);
  std::vector<uint8_t> get(const std::string& key);
  int64_t add(const std::string& key, int64_t value);
  /// Sets `key` for as long as this client's connection lasts: the server deletes it when the
  /// connection closes (the client's process ended, or it dropped the connection after a failed
  /// call), unless a later call (from any connection) set the key since. Like ZooKeeper's
  /// ephemeral nodes; it tells a peer that ended from one that cannot be reached.
  void setEphemeral(const std::string& key, const std::vector<uint8_t>& value);
  bool deleteKey(const std::string& key);
  bool check(const std::vector<std::string>& keys);
  int64_t getNumKeys();
  void wait(const std::vector<std::string>& keys);
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  /// Another client of the same server, with this one's timeout (TCPStore::clone).
  std::unique_ptr<SocketStore> clone() const;

  /// Why the last call failed, as far as the network tells: kNone when it succeeded (or failed in
  /// the store itself, e.g. a wait that timed out); kGone when no server is there any more (the
  /// connection was refused, closed or reset); kUnreachable when the server did not answer in
  /// time or the network has no way to it (a partition, a host that stopped), which may pass.
  enum class Failure { kNone, kGone, kUnreachable };
  Failure lastFailure() const { return last_failure_.load(); }

 private:
  // One request and its reply; `wait_for` is how long the server may hold a get or wait.
  std::string call(uint8_t op,
                   const std::vector<std::string>& fields,
                   std::chrono::milliseconds wait_for,
                   const std::string& what);
  std::string send_locked(const std::string& request,
                          bool bounded,
                          std::chrono::steady_clock::time_point deadline);
  std::string receive_locked(std::string& reply,
                             bool bounded,
                             std::chrono::steady_clock::time_point deadline);
  void connect_locked(std::chrono::milliseconds timeout);
  void drop_locked(bool abortive = false);
  std::string where() const;

  std::string host_;
  int port_;
  std::atomic<int64_t> timeout_ms_;
  std::unique_ptr<StoreServer> server_;
  std::mutex mutex_;
  int fd_ = -1;
  std::atomic<Failure> last_failure_{Failure::kNone};
};

}  // namespace detail
}  // namespace dist
}  // namespace paratrain
