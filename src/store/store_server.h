#pragma once

// Internal to store/: the socket store's server (socket_store.h), which a SocketStore made with
// `serve` owns.

#include "store_wire.h"

#include <poll.h>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace paratrain {
namespace dist {
namespace detail {

// The server: one thread polls the listening sockets and the clients. A get or wait on a missing
// key parks its client (which sends nothing more until answered) until a set, add or compareSet
// brings the keys, or its limit passes; the answer then says which.
class StoreServer {
 public:
  StoreServer(const std::string& host, int port);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;
  int port() const { return port_; }

 private:
  struct Client {
    uint64_t id = 0;                  // unique for the server's life (descriptors are reused)
    std::set<std::string> ephemeral;  // keys it set with kSetEphemeral
    std::string in;
    std::string out;
    bool bad = false;
    bool waiting = false;
    uint8_t op = 0;
    std::vector<std::string> keys;
    bool has_deadline = false;
    store_wire::Clock::time_point deadline;
  };

  void bind_all(const std::string& host, int port);
  void close_listeners();
  void run();
  void handle_io(const std::vector<pollfd>& polled);
  bool step(Client& c);
  void execute(Client& c, uint8_t op, int64_t hold_ms, const std::vector<std::string>& f);
  void add(Client& c, const std::string& key, const std::string& amount);
  bool present(const std::vector<std::string>& keys) const;
  void expire_waits();
  int next_deadline_ms() const;
  static void reply(Client& c, uint8_t status, const std::string& payload);
  static bool flush(int fd, Client& c);
  void drop(std::map<int, Client>::iterator it);

  std::vector<int> listeners_;
  int wake_[2] = {-1, -1};
  int port_ = 0;
  std::map<int, Client> clients_;
  std::unordered_map<std::string, std::string> data_;
  std::unordered_map<std::string, uint64_t> owner_;  // ephemeral keys: the client that set them
  uint64_t next_client_id_ = 0;
  std::thread thread_;
};

}  // namespace detail
}  // namespace dist
}  // namespace paratrain
