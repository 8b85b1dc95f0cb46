// The socket store's server: the listening sockets, the clients' requests, parked gets and
// waits, and the ephemeral keys.

#include "store_server.h"

#include <c10/util/Exception.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <iostream>

namespace paratrain {
namespace dist {
namespace detail {

using namespace store_wire;  // the wire's names: this file's vocabulary

StoreServer::StoreServer(const std::string& host, int port) : port_(port) {
  bind_all(host, port);
  if (::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
    const int err = errno;
    for (int fd : listeners_) {
      ::close(fd);
    }
    TORCH_CHECK(false, "cannot start the store's server: pipe: ", errno_text(err));
  }
  try {
    thread_ = std::thread([this] { run(); });
  } catch (...) {
    close_listeners();
    ::close(wake_[0]);
    ::close(wake_[1]);
    throw;
  }
}

void StoreServer::close_listeners() {
  for (int fd : listeners_) {
    ::close(fd);
  }
  listeners_.clear();
}

StoreServer::~StoreServer() {
  const char stop = 1;
  while (::write(wake_[1], &stop, 1) < 0 && errno == EINTR) {
  }
  thread_.join();
  for (auto& kv : clients_) {
    ::close(kv.first);
  }
  close_listeners();
  ::close(wake_[0]);
  ::close(wake_[1]);
}

// Binds every address `host` resolves to. One that is in use fails the whole server (as c10d
// says it: "Address already in use"); one this host does not have (an IPv6 name without IPv6)
// is skipped while another binds.
void StoreServer::bind_all(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  TORCH_CHECK(rc == 0, "cannot resolve '", host, "' to serve the store on it: ", gai_strerror(rc));
  std::string in_use;
  std::string other;
  std::set<std::string> seen;  // getaddrinfo repeats an address listed twice in /etc/hosts
  for (addrinfo* a = found; a != nullptr && in_use.empty(); a = a->ai_next) {
    if (!seen.insert(std::string(reinterpret_cast<const char*>(a->ai_addr), a->ai_addrlen))
             .second) {
      continue;
    }
    sockaddr_storage addr{};
    std::memcpy(&addr, a->ai_addr, a->ai_addrlen);
    if (port_ != 0) {  // port 0: later addresses take the port the first one got
      if (addr.ss_family == AF_INET) {
        reinterpret_cast<sockaddr_in*>(&addr)->sin_port = htons(static_cast<uint16_t>(port_));
      } else if (addr.ss_family == AF_INET6) {
        reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port = htons(static_cast<uint16_t>(port_));
      }
    }
    int fd = ::socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      other = "socket: " + errno_text(errno);
      continue;
    }
    const int on = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
    if (a->ai_family == AF_INET6) {
      ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &on, sizeof(on));
    }
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), a->ai_addrlen) != 0 ||
        ::listen(fd, SOMAXCONN) != 0) {
      // The errno's name goes with its text: callers tell "not this host's address" apart by it.
      const int err = errno;
      (err == EADDRINUSE ? in_use : other) =
          errno_text(err) + (err == EADDRNOTAVAIL ? " (EADDRNOTAVAIL)" : "");
      ::close(fd);
      continue;
    }
    if (port_ == 0) {
      socklen_t len = sizeof(addr);
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
      port_ = ntohs(addr.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&addr)->sin_port
                                              : reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
    }
    listeners_.push_back(fd);
  }
  ::freeaddrinfo(found);
  if (!in_use.empty() || listeners_.empty()) {
    close_listeners();
    TORCH_CHECK(false, "failed to bind ", host, ":", port, ": ",
                in_use.empty() ? other : "Address already in use (EADDRINUSE)");
  }
}

void StoreServer::run() {
  for (;;) {
    std::vector<pollfd> polled{{wake_[0], POLLIN, 0}};
    for (int fd : listeners_) {
      polled.push_back({fd, POLLIN, 0});
    }
    for (auto& kv : clients_) {
      polled.push_back(
          {kv.first, static_cast<short>(POLLIN | (kv.second.out.empty() ? 0 : POLLOUT)), 0});
    }
    const int rc = ::poll(polled.data(), polled.size(), next_deadline_ms());
    if (rc < 0 && errno != EINTR) {
      // Nothing is served from here on; every client's call fails at its deadline.
      std::cerr << "paratrain: the store's server stopped: poll: " << errno_text(errno)
                << std::endl;
      // New clients are refused, not left in the backlog, and those connected see it closed.
      close_listeners();
      for (auto& kv : clients_) {
        ::close(kv.first);
      }
      clients_.clear();
      return;
    }
    if (rc > 0 && polled[0].revents != 0) {
      return;
    }
    if (rc > 0) {
      handle_io(polled);
    }
    expire_waits();
    // Until nothing moves: a request may bring keys that parked clients wait for, and an answered
    // client may have its next request buffered.
    for (bool moved = true; moved;) {
      moved = false;
      for (auto& kv : clients_) {
        while (!kv.second.bad && step(kv.second)) {
          moved = true;
        }
      }
    }
    for (auto it = clients_.begin(); it != clients_.end();) {
      if (it->second.bad || !flush(it->first, it->second)) {
        drop(it++);
      } else {
        ++it;
      }
    }
  }
}

// Closes a client's connection; the ephemeral keys it still owns go with it.
void StoreServer::drop(std::map<int, Client>::iterator it) {
  for (const std::string& k : it->second.ephemeral) {
    auto owner = owner_.find(k);
    if (owner != owner_.end() && owner->second == it->second.id) {
      owner_.erase(owner);
      data_.erase(k);
    }
  }
  ::close(it->first);
  clients_.erase(it);
}

void StoreServer::handle_io(const std::vector<pollfd>& polled) {
  for (size_t i = 1; i < polled.size(); ++i) {
    const pollfd& p = polled[i];
    if (p.revents == 0) {
      continue;
    }
    if (i <= listeners_.size()) {
      int fd = ::accept4(p.fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd >= 0) {
        const int on = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
        clients_[fd].id = next_client_id_++;
      } else if (errno == EMFILE || errno == ENFILE) {
        // The connection waits in the backlog, and poll would report it at once again.
        std::this_thread::sleep_for(milliseconds(50));
      }
      continue;
    }
    Client& c = clients_[p.fd];
    if ((p.revents & POLLOUT) != 0 && !flush(p.fd, c)) {
      c.bad = true;
    }
    if ((p.revents & (POLLIN | POLLHUP | POLLERR)) == 0) {
      continue;
    }
    char buf[65536];
    ssize_t n = ::recv(p.fd, buf, sizeof(buf), 0);
    if (n > 0) {
      c.in.append(buf, static_cast<size_t>(n));
    } else if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      c.bad = true;  // the peer closed or failed: drop it with whatever it was waiting for
    }
  }
}

// Answers a parked client whose keys came, or runs the next whole request in its buffer.
// False when it can do neither.
bool StoreServer::step(Client& c) {
  if (c.waiting) {
    if (!present(c.keys)) {
      return false;
    }
    c.waiting = false;
    reply(c, kOk, c.op == kGet ? data_[c.keys[0]] : std::string());
    return true;
  }
  if (c.in.size() < 4) {
    return false;
  }
  const auto len = static_cast<uint32_t>(get_be(c.in, 0, 4));
  if (len > kMaxFrame || len < 13) {
    c.bad = true;
    return false;
  }
  if (c.in.size() < 4 + static_cast<size_t>(len)) {
    return false;
  }
  const std::string body = c.in.substr(4, len);
  c.in.erase(0, 4 + static_cast<size_t>(len));
  const auto op = static_cast<uint8_t>(body[0]);
  const auto hold_ms = static_cast<int64_t>(get_be(body, 1, 8));
  const auto count = get_be(body, 9, 4);
  std::vector<std::string> fields;
  size_t at = 13;
  for (uint64_t i = 0; i < count; ++i) {
    if (body.size() < at + 4 || body.size() - at - 4 < get_be(body, at, 4)) {
      c.bad = true;
      return false;
    }
    const auto n = static_cast<size_t>(get_be(body, at, 4));
    fields.push_back(body.substr(at + 4, n));
    at += 4 + n;
  }
  execute(c, op, hold_ms, fields);
  return true;
}

void StoreServer::execute(Client& c,
                          uint8_t op,
                          int64_t hold_ms,
                          const std::vector<std::string>& f) {
  static const std::map<uint8_t, size_t> kFields = {{kSet, 2},         {kGet, 1},    {kAdd, 2},
                                                    {kCompareSet, 3},  {kDelete, 1}, {kNumKeys, 0},
                                                    {kSetEphemeral, 2}};
  auto need = kFields.find(op);
  if ((need != kFields.end() && f.size() != need->second) ||
      (need == kFields.end() && op != kCheck && op != kWait)) {
    c.bad = true;
    return;
  }
  if (op != kCheck && op != kWait && op != kGet && op != kNumKeys) {
    owner_.erase(f[0]);  // whoever writes a key last decides how long it lives
  }
  switch (op) {
    case kSet:
      data_[f[0]] = f[1];
      reply(c, kOk, "");
      return;
    case kSetEphemeral:
      data_[f[0]] = f[1];
      owner_[f[0]] = c.id;
      c.ephemeral.insert(f[0]);
      reply(c, kOk, "");
      return;
    case kGet:
    case kWait:
      if (present(f)) {
        reply(c, kOk, op == kGet ? data_[f[0]] : std::string());
        return;
      }
      c.waiting = true;
      c.op = op;
      c.keys = f;
      c.has_deadline = hold_ms >= 0 && milliseconds(hold_ms) < kForever;
      c.deadline = c.has_deadline ? Clock::now() + milliseconds(hold_ms) : Clock::time_point();
      return;
    case kAdd:
      add(c, f[0], f[1]);
      return;
    case kCompareSet: {
      // c10d's semantics: a missing key is created only when `expected` is empty; the answer is
      // the value the key holds afterwards (for a missing key, `expected` itself).
      auto it = data_.find(f[0]);
      if (it == data_.end()) {
        if (f[1].empty()) {
          data_[f[0]] = f[2];
        }
        reply(c, kOk, f[1].empty() ? f[2] : f[1]);
      } else {
        if (it->second == f[1]) {
          it->second = f[2];
        }
        reply(c, kOk, it->second);
      }
      return;
    }
    case kCheck:
      reply(c, kOk, present(f) ? "1" : "0");
      return;
    case kDelete:
      reply(c, kOk, data_.erase(f[0]) > 0 ? "1" : "0");
      return;
    case kNumKeys:
      reply(c, kOk, std::to_string(data_.size()));
      return;
    default:
      c.bad = true;
  }
}

void StoreServer::add(Client& c, const std::string& key, const std::string& amount) {
  int64_t delta = 0;
  int64_t current = 0;
  auto it = data_.find(key);
  if (!parse_int64(amount, delta) || (it != data_.end() && !parse_int64(it->second, current))) {
    reply(c, kFailed, "key '" + key + "' does not hold an integer");
    return;
  }
  data_[key] = std::to_string(current + delta);
  reply(c, kOk, data_[key]);
}

bool StoreServer::present(const std::vector<std::string>& keys) const {
  return std::all_of(keys.begin(), keys.end(),
                     [&](const std::string& k) { return data_.count(k) > 0; });
}

void StoreServer::expire_waits() {
  const auto now = Clock::now();
  for (auto& kv : clients_) {
    Client& c = kv.second;
    if (c.waiting && c.has_deadline && c.deadline <= now && !present(c.keys)) {
      c.waiting = false;
      reply(c, kTimedOut, "");
    }
  }
}

int StoreServer::next_deadline_ms() const {
  bool any = false;
  Clock::time_point first;
  for (const auto& kv : clients_) {
    const Client& c = kv.second;
    if (c.waiting && c.has_deadline && (!any || c.deadline < first)) {
      first = c.deadline;
      any = true;
    }
  }
  return poll_ms(any, first);
}

void StoreServer::reply(Client& c, uint8_t status, const std::string& payload) {
  c.out += frame(std::string(1, static_cast<char>(status)) + payload);
}

// Sends what the socket takes now; false when the peer is gone.
bool StoreServer::flush(int fd, Client& c) {
  while (!c.out.empty()) {
    ssize_t n = ::send(fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
    if (n > 0) {
      c.out.erase(0, static_cast<size_t>(n));
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return true;
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      return false;
    }
  }
  return true;
}

}  // namespace detail
}  // namespace dist
}  // namespace paratrain
