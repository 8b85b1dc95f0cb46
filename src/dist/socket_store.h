#pragma once

// Internal: paratrain's key-value store over TCP, a c10d::Store that Gloo, NCCL and the launcher's
// rendezvous use as they would c10d's TCPStore.
//
// Why not c10d's TCPStore: its server in libtorch 1.13 listens on every address of the host
// (getaddrinfo(nullptr, AI_PASSIVE)); 2.x can be told otherwise only by handing it a socket, and
// 1.13 not at all. A job must serve its store and its rendezvous only where --master-addr says, and
// a one-node job on loopback only. This store binds exactly the addresses its host name resolves
// to, on both libtorch versions. Every call also has a deadline (TCPStore's add, set and check wait
// forever on a peer that stopped answering), and a timed-out connection is never reused.

#include <torch/csrc/distributed/c10d/Store.hpp>

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

/// A client of the store at host:port; with `serve`, also its server, which lives as long as this
/// object. The server binds every address `host` resolves to (port 0: a free port, see port()).
/// A client retries connecting until `timeout`. Every call waits at most the store's timeout
/// (setTimeout; get and wait count it while the key is missing); kNoTimeout waits without end.
/// Thread-safe: calls on one object are serialised.
class SocketStore : public c10d::Store {
 public:
  SocketStore(std::string host, int port, bool serve, std::chrono::milliseconds timeout);
  ~SocketStore() override;

  /// The port served or connected to.
  int port() const { return port_; }

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key,
                                  const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;
  /// Another client of the same server, with this one's timeout (TCPStore::clone). Declared
  /// without `override`: libtorch 2.7 added Store::clone() as pure virtual, and 1.13 to 2.6 have
  /// none, so this overrides it where it exists and is an ordinary method where it does not.
#if defined(__clang__)
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Winconsistent-missing-override"
#endif
  c10::intrusive_ptr<c10d::Store> clone();
#if defined(__clang__)
#pragma clang diagnostic pop
#endif

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
  void drop_locked();
  std::string where() const;

  std::string host_;
  int port_;
  std::unique_ptr<StoreServer> server_;
  std::mutex mutex_;
  int fd_ = -1;
};

/// Whether every address `host` resolves to is a loopback address (127.0.0.0/8, ::1). Such a
/// store cannot be reached from another host.
bool resolves_to_loopback_only(const std::string& host);

/// Whether `host` is a name (not an address literal) for loopback only: Debian names its own host
/// 127.0.1.1 in /etc/hosts, so `$(hostname)` as a job's address would serve where no other host
/// reaches, where c10d's TCPStore, serving every address, hid the mistake.
bool is_loopback_name(const std::string& host);

}  // namespace detail
}  // namespace dist
}  // namespace paratrain
