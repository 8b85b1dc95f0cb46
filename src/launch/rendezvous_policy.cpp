#include "rendezvous_policy.h"

#include "rendezvous.h"

#include "base/errors.h"
#include "paratrain/launch/launch.h"  // pick_free_port
#include "paratrain/store/host_address.h"

#include <c10/util/Exception.h>

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <iostream>

namespace paratrain {
namespace dist {
namespace detail {
namespace {

using paratrain::detail::error_message;

// The deadline of each etcd call once connected: long enough for a loaded server, short enough
// that a launcher whose endpoint vanished without a reset notices within seconds.
constexpr std::chrono::milliseconds kStoreCallTimeout{5000};
// How long a launcher tries to reach etcd: a server that runs already, unlike the c10d endpoint,
// which waits for the launcher that serves it.
constexpr std::chrono::milliseconds kEtcdConnect{30000};

// The socket store's calls: a quarter of the keep-alive time (within 0.25 s to 5 s), so that a
// node rides out several failed calls before it takes the store for lost, and the supervisor that
// asks must_restart while the workers run waits no longer than that on each. The store answers
// in microseconds; a call that takes a quarter second is a network that does not deliver.
std::chrono::milliseconds socket_call_timeout(std::chrono::milliseconds keep_alive) {
  return std::clamp<std::chrono::milliseconds>(keep_alive / 4, std::chrono::milliseconds(250),
                                               kStoreCallTimeout);
}

// Whether `host` names an address of this machine: binding to it succeeds only then.
bool is_local_address(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) {
    return false;
  }
  bool local = false;
  for (addrinfo* a = found; a != nullptr && !local; a = a->ai_next) {
    int fd = socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0) {
      local = bind(fd, a->ai_addr, a->ai_addrlen) == 0;
      close(fd);
    }
  }
  freeaddrinfo(found);
  return local;
}

// paratrain's socket store, served by one launcher: the one on the endpoint's host (c10d), or
// node 0 (static). `flag` sets the endpoint, `what` is what the store holds.
class SocketStorePolicy : public RendezvousPolicy {
 public:
  using RendezvousPolicy::RendezvousPolicy;

  std::unique_ptr<RendezvousStore> open_store(bool* serving) const override {
    *serving = false;
    std::unique_ptr<RendezvousStore> store;
    const auto call_timeout = socket_call_timeout(o_.keep_alive);
    if (serves()) {
      try {
        store = open_socket_store(o_.host, o_.port, /*serve=*/true, o_.join_timeout, call_timeout);
        *serving = true;
        warn_if_loopback_only();
      } catch (const std::exception& e) {
        serve_failed(e);
      }
    }
    if (store) {
      return store;
    }
    try {
      return open_socket_store(o_.host, o_.port, /*serve=*/false, o_.join_timeout, call_timeout);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "rendezvous '", o_.id, "' at ", o_.host, ":", o_.port,
                  ": cannot reach the endpoint within ", o_.join_timeout.count() / 1000.0, " s (",
                  error_message(e), "); start the node on ", o_.host, " (", server(), ") or fix ",
                  flag());
    }
    return nullptr;  // not reached
  }

 protected:
  virtual bool serves() const = 0;
  /// This launcher could not serve the store at the endpoint.
  virtual void serve_failed(const std::exception& e) const = 0;
  virtual const char* flag() const = 0;    // the flag that names the endpoint
  virtual const char* server() const = 0;  // who serves it
  virtual const char* what() const = 0;    // what it holds

 private:
  void warn_if_loopback_only() const {
    if (o_.max_nodes > 1 && is_loopback_name(o_.host)) {
      std::cerr << "paratrain launch: warning: " << flag() << " host " << o_.host
                << " resolves only to loopback addresses here, where the " << what()
                << " is served; nodes on other hosts cannot reach it: give an address they "
                   "reach"
                << std::endl;
    }
  }
};

class C10dPolicy : public SocketStorePolicy {
 public:
  using SocketStorePolicy::SocketStorePolicy;
  std::string how_to_join() const override {
    return "start them with --rdzv-endpoint " + o_.host + ":" + std::to_string(o_.port) +
           " --rdzv-id " + o_.id;
  }

 protected:
  bool serves() const override { return is_local_address(o_.host); }
  // Another launcher on this host serves it already: this one joins as a client.
  void serve_failed(const std::exception&) const override {}
  const char* flag() const override { return "--rdzv-endpoint"; }
  const char* server() const override { return "it serves the rendezvous"; }
  const char* what() const override { return "rendezvous"; }
};

class StaticPolicy : public SocketStorePolicy {
 public:
  using SocketStorePolicy::SocketStorePolicy;

  // A second node claiming the same rank is refused (two launchers given one --node-rank).
  int64_t claim_place(RendezvousStore& store,
                      const RendezvousKeys& keys,
                      int64_t round,
                      const std::string& me) const override {
    const std::string holder = store.compare_set(keys.claim(round, o_.fixed_node_rank), "", me);
    TORCH_CHECK(holder == me, "two nodes claim node rank ", o_.fixed_node_rank, " (", holder,
                " and this one, ", me,
                "): give each node its own --node-rank (a launcher started again while its job "
                "runs cannot rejoin a static job: restart the whole job)");
    return o_.fixed_node_rank + 1;
  }
  std::string round_master(const std::string&) const override { return o_.fixed_master; }
  bool restart_left(const Assignment& a) const override { return a.round < o_.max_restarts; }
  PeerEnded on_peer_ended() const override { return PeerEnded::kEndJob; }
  bool needs_serving_node(const Assignment& a) const override { return a.node_rank > 0; }
  std::string how_to_join() const override {
    return "start each with its --node-rank, --master-addr " + o_.host + " and --master-port " +
           std::to_string(o_.port - 1);
  }

 protected:
  bool serves() const override { return o_.fixed_node_rank == 0; }
  void serve_failed(const std::exception& e) const override {
    TORCH_CHECK(false, "node 0 cannot serve the launchers' store at ", o_.host, ":", o_.port,
                " (--master-port + 1, where the nodes agree on restarts): ", error_message(e),
                "; pick another --master-port");
  }
  const char* flag() const override { return "--master-addr"; }
  const char* server() const override { return "node 0 serves it"; }
  const char* what() const override { return "launchers' store"; }
};

class EtcdPolicy : public RendezvousPolicy {
 public:
  using RendezvousPolicy::RendezvousPolicy;
  std::unique_ptr<RendezvousStore> open_store(bool* serving) const override {
    *serving = false;
    return open_etcd_store(o_.host, o_.port,
                           std::min<std::chrono::milliseconds>(o_.join_timeout, kEtcdConnect),
                           kStoreCallTimeout);
  }
  bool store_outlives_nodes() const override { return true; }
  StoreFailure on_store_failure() const override { return StoreFailure::kRetryLater; }
  std::string how_to_join() const override {
    return "start them with --rdzv-backend etcd --rdzv-endpoint " + o_.host + ":" +
           std::to_string(o_.port) + " --rdzv-id " + o_.id;
  }
};

}  // namespace

int64_t RendezvousPolicy::claim_place(RendezvousStore&,
                                      const RendezvousKeys&,
                                      int64_t,
                                      const std::string&) const {
  return 0;
}

std::string RendezvousPolicy::round_master(const std::string& my_address) const {
  return my_address + ":" + std::to_string(pick_free_port());
}

bool RendezvousPolicy::restart_left(const Assignment&) const {
  return true;
}

bool RendezvousPolicy::needs_serving_node(const Assignment&) const {
  return false;
}

std::unique_ptr<RendezvousPolicy> make_rendezvous_policy(const RendezvousOptions& options) {
  if (options.fixed_node_rank >= 0) {
    return std::make_unique<StaticPolicy>(options);
  }
  if (options.backend == "etcd") {
    return std::make_unique<EtcdPolicy>(options);
  }
  TORCH_CHECK(options.backend == "c10d", "unknown rendezvous backend '", options.backend,
              "': use c10d or etcd");
  return std::make_unique<C10dPolicy>(options);
}

}  // namespace detail
}  // namespace dist
}  // namespace paratrain
