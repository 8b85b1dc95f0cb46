#include "socket_store.h"

#include <c10/util/Exception.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <set>
#include <thread>
#include <unordered_map>

namespace paratrain {
namespace dist {
namespace detail {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// The wire format, ours at both ends. A frame is a 4-byte big-endian length and its body.
// Request body: op (1 byte), how long a get/wait may be held in ms (8 bytes, -1: no limit), the
// number of fields (4 bytes), then each field as a length (4 bytes) and its bytes.
// Reply body: a status (1 byte) and the payload.
enum Op : uint8_t {
  kSet = 1,
  kGet,
  kAdd,
  kCompareSet,
  kCheck,
  kDelete,
  kNumKeys,
  kWait,
  kSetEphemeral  // a set whose key the server deletes when the setter's connection closes
};
enum Status : uint8_t { kOk = 0, kTimedOut = 1, kFailed = 2 };

// Frames beyond this are a foreign or broken peer, not a store value.
constexpr uint32_t kMaxFrame = 1u << 30;
// How long past a held get/wait's own limit a client waits for the server's answer, before it
// takes the server for gone.
constexpr milliseconds kReplyGrace{5000};
// Limits beyond this are taken as none: adding them to a clock's now() would overflow.
constexpr milliseconds kForever = std::chrono::hours(24 * 365 * 100);

// kNoStoreTimeout (0) and limits past kForever wait without end; a negative one has already passed.
bool limited(milliseconds timeout) {
  return timeout != milliseconds::zero() && timeout < kForever;
}

void put_u32(std::string& out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) {
    out.push_back(static_cast<char>((v >> shift) & 0xff));
  }
}

void put_i64(std::string& out, int64_t v) {
  const auto u = static_cast<uint64_t>(v);
  for (int shift = 56; shift >= 0; shift -= 8) {
    out.push_back(static_cast<char>((u >> shift) & 0xff));
  }
}

uint64_t get_be(const std::string& in, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) {
    v = (v << 8) | static_cast<unsigned char>(in[at + i]);
  }
  return v;
}

std::string frame(const std::string& body) {
  std::string out;
  put_u32(out, static_cast<uint32_t>(body.size()));
  return out + body;
}

std::string errno_text(int err) {
  return std::strerror(err);
}

bool parse_int64(const std::string& text, int64_t& out) {
  if (text.empty()) {
    return false;
  }
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || end != text.c_str() + text.size()) {
    return false;
  }
  out = v;
  return true;
}

// Milliseconds left until `deadline`, for poll(); -1 when there is none.
int poll_ms(bool has_deadline, Clock::time_point deadline) {
  if (!has_deadline) {
    return -1;
  }
  auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count() + 1;
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1 << 30));
}

// Waits until `fd` is ready for `events`; false at the deadline.
bool await(int fd, short events, bool has_deadline, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    int rc = ::poll(&p, 1, poll_ms(has_deadline, deadline));
    if (rc > 0) {
      return true;
    }
    // poll's limit is capped (poll_ms), so a quiet return before the deadline waits on.
    if ((rc == 0 && has_deadline && Clock::now() >= deadline) || (rc < 0 && errno != EINTR)) {
      return false;
    }
  }
}

void set_nonblocking(int fd) {
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
}

}  // namespace

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
    Clock::time_point deadline;
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

// ---- the client ----

SocketStore::SocketStore(std::string host, int port, bool serve, milliseconds timeout)
    : host_(std::move(host)), port_(port), timeout_ms_(timeout.count()) {
  if (serve) {
    server_ = std::make_unique<StoreServer>(host_, port_);
    port_ = server_->port();
  }
  std::lock_guard<std::mutex> lock(mutex_);
  connect_locked(timeout);
}

std::unique_ptr<SocketStore> SocketStore::clone() const {
  return std::make_unique<SocketStore>(host_, port_, /*serve=*/false, getTimeout());
}

SocketStore::~SocketStore() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    drop_locked();
  }
  server_.reset();
}

std::string SocketStore::where() const {
  return (host_.find(':') != std::string::npos ? "[" + host_ + "]" : host_) + ":" +
         std::to_string(port_);
}

void SocketStore::drop_locked(bool abortive) {
  if (fd_ >= 0) {
    if (abortive) {
      // A reset, not a close: the kernel would otherwise still deliver the request it holds (a
      // partition heals), after the retry on a new connection, and undo it (a set, say).
      const linger reset{1, 0};
      ::setsockopt(fd_, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
    }
    ::close(fd_);
    fd_ = -1;
  }
}

// Connects to host:port, retrying refused and unreachable attempts until `timeout`
// (kNoStoreTimeout: without end), as c10d's clients do while the server starts.
void SocketStore::connect_locked(milliseconds timeout) {
  const bool bounded = limited(timeout);
  const auto deadline = bounded ? Clock::now() + timeout : Clock::time_point::max();
  std::string last = "no address";
  milliseconds pause{20};
  for (;;) {
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    addrinfo* found = nullptr;
    const int rc = ::getaddrinfo(host_.c_str(), std::to_string(port_).c_str(), &hints, &found);
    if (rc != 0) {
      last = std::string("cannot resolve '") + host_ + "': " + gai_strerror(rc);
    }
    for (addrinfo* a = rc == 0 ? found : nullptr; a != nullptr && fd_ < 0; a = a->ai_next) {
      int fd = ::socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (fd < 0) {
        last = "socket: " + errno_text(errno);
        continue;
      }
      int err = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0 ? 0 : errno;
      if (err == EINPROGRESS) {
        // A host that drops SYNs would hold a blocking connect for minutes: bound each try.
        const auto try_until = Clock::now() + std::chrono::seconds(5);
        socklen_t len = sizeof(err);
        err = await(fd, POLLOUT, true, std::min(deadline, try_until))
                  ? (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 ? err : errno)
                  : ETIMEDOUT;
      }
      if (err != 0) {
        last = errno_text(err);
        ::close(fd);
        continue;
      }
      const int on = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
      set_nonblocking(fd);
      fd_ = fd;
    }
    if (found != nullptr) {
      ::freeaddrinfo(found);
    }
    if (fd_ >= 0) {
      return;
    }
    if (bounded && Clock::now() + pause >= deadline) {
      // Refused: the host is there and nothing listens (the server's process ended).
      last_failure_ = last == errno_text(ECONNREFUSED) ? Failure::kGone : Failure::kUnreachable;
      TORCH_CHECK(false, "cannot connect to ", where(), " within ", timeout.count(), " ms: ", last);
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, milliseconds(1000));
  }
}

std::string SocketStore::call(uint8_t op,
                              const std::vector<std::string>& fields,
                              milliseconds wait_for,
                              const std::string& what) {
  std::string body(1, static_cast<char>(op));
  const bool holds = op == kGet || op == kWait;
  put_i64(body, holds && limited(wait_for) ? std::max<int64_t>(wait_for.count(), 0) : -1);
  put_u32(body, static_cast<uint32_t>(fields.size()));
  for (const auto& f : fields) {
    TORCH_CHECK(f.size() < kMaxFrame && body.size() + 4 + f.size() < kMaxFrame, what, ": ",
                body.size() + 4 + f.size(), " bytes or more are too many for one store request (",
                kMaxFrame, " at most)");
    put_u32(body, static_cast<uint32_t>(f.size()));
    body += f;
  }
  const std::string request = frame(body);
  const milliseconds timeout = getTimeout();

  std::lock_guard<std::mutex> lock(mutex_);
  if (fd_ < 0) {
    connect_locked(timeout);  // the last call failed midway; its connection was dropped
  }
  // A held call may last its own limit; the server then answers, so the client waits a little
  // longer before it calls the server gone.
  const milliseconds budget = holds ? wait_for + kReplyGrace : timeout;
  const bool bounded = limited(holds ? wait_for : timeout);
  const auto deadline = bounded ? Clock::now() + budget : Clock::time_point::max();
  std::string reply;
  std::string why = send_locked(request, bounded, deadline);
  if (why.empty()) {
    why = receive_locked(reply, bounded, deadline);
  }
  if (!why.empty()) {
    // Closed or reset by the server's end, or not a store: nothing serves there now. No reply in
    // time, or no route: the network, which may come back.
    const bool gone = why.rfind("the server closed", 0) == 0 || why.rfind("a malformed", 0) == 0 ||
                      why == errno_text(ECONNRESET) || why == errno_text(EPIPE);
    last_failure_ = gone ? Failure::kGone : Failure::kUnreachable;
    drop_locked(/*abortive=*/true);  // the reply may still come: out of step for good
    TORCH_CHECK(
        false, what, " on the store at ", where(), " failed: ", why,
        why.rfind("no ", 0) == 0 ? " within " + std::to_string(budget.count()) + " ms" : "");
  }
  last_failure_ = Failure::kNone;
  const auto status = static_cast<uint8_t>(reply[4]);
  std::string payload = reply.substr(5);
  TORCH_CHECK(status != kTimedOut, "timed out after ", wait_for.count(), " ms waiting for ", what,
              " in the store at ", where());
  TORCH_CHECK(status == kOk, what, " on the store at ", where(), " failed: ", payload);
  return payload;
}

// Sends all of `request`; "" when done, else why not.
std::string SocketStore::send_locked(const std::string& request,
                                     bool bounded,
                                     Clock::time_point deadline) {
  for (size_t sent = 0; sent < request.size();) {
    ssize_t n = ::send(fd_, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
    } else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      return errno_text(errno);
    } else if (!await(fd_, POLLOUT, bounded, deadline)) {
      return "no progress sending";  // the server stopped reading
    }
  }
  return "";
}

// Reads one whole reply frame into `reply`; "" when done, else why not.
std::string SocketStore::receive_locked(std::string& reply,
                                        bool bounded,
                                        Clock::time_point deadline) {
  size_t want = 4;
  while (reply.size() < want) {
    char buf[65536];
    ssize_t n = ::recv(fd_, buf, std::min(sizeof(buf), want - reply.size()), 0);
    if (n > 0) {
      reply.append(buf, static_cast<size_t>(n));
      if (want == 4 && reply.size() == 4) {
        want = 4 + get_be(reply, 0, 4);
        if (want < 5 || want > 4 + static_cast<size_t>(kMaxFrame)) {
          return "a malformed reply (not paratrain's store?)";
        }
      }
    } else if (n == 0) {
      return "the server closed the connection (its process has probably exited)";
    } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      return errno_text(errno);
    } else if (!await(fd_, POLLIN, bounded, deadline)) {
      return "no reply";
    }
  }
  return "";
}

namespace {

std::string bytes(const std::vector<uint8_t>& v) {
  return std::string(v.begin(), v.end());
}

std::vector<uint8_t> to_vector(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

std::string describe_keys(const std::vector<std::string>& keys) {
  std::string out = keys.size() == 1 ? "key " : "keys ";
  for (size_t i = 0; i < keys.size(); ++i) {
    out += (i ? ", '" : "'") + keys[i] + "'";
  }
  return out;
}

int64_t to_int64(const std::string& text, const std::string& what) {
  int64_t v = 0;
  TORCH_CHECK(parse_int64(text, v), what, ": the store answered '", text, "', not an integer");
  return v;
}

}  // namespace

void SocketStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  call(kSet, {key, bytes(value)}, kNoStoreTimeout, "set of key '" + key + "'");
}

void SocketStore::setEphemeral(const std::string& key, const std::vector<uint8_t>& value) {
  call(kSetEphemeral, {key, bytes(value)}, kNoStoreTimeout, "set of key '" + key + "'");
}

std::vector<uint8_t> SocketStore::compareSet(const std::string& key,
                                             const std::vector<uint8_t>& expected,
                                             const std::vector<uint8_t>& desired) {
  return to_vector(call(kCompareSet, {key, bytes(expected), bytes(desired)}, kNoStoreTimeout,
                        "compareSet of key '" + key + "'"));
}

std::vector<uint8_t> SocketStore::get(const std::string& key) {
  return to_vector(call(kGet, {key}, getTimeout(), describe_keys({key})));
}

int64_t SocketStore::add(const std::string& key, int64_t value) {
  const std::string what = "add to key '" + key + "'";
  return to_int64(call(kAdd, {key, std::to_string(value)}, kNoStoreTimeout, what), what);
}

bool SocketStore::deleteKey(const std::string& key) {
  return call(kDelete, {key}, kNoStoreTimeout, "delete of key '" + key + "'") == "1";
}

bool SocketStore::check(const std::vector<std::string>& keys) {
  return call(kCheck, keys, kNoStoreTimeout, "check of " + describe_keys(keys)) == "1";
}

int64_t SocketStore::getNumKeys() {
  return to_int64(call(kNumKeys, {}, kNoStoreTimeout, "count of keys"), "count of keys");
}

void SocketStore::wait(const std::vector<std::string>& keys) {
  wait(keys, getTimeout());
}

void SocketStore::wait(const std::vector<std::string>& keys, milliseconds timeout) {
  call(kWait, keys, timeout, describe_keys(keys));
}

bool resolves_to_loopback_only(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) {
    return false;
  }
  bool all = found != nullptr;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      all =
          all && (ntohl(reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr.s_addr) >> 24) == 127;
    } else if (a->ai_family == AF_INET6) {
      all = all && IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr);
    } else {
      all = false;
    }
  }
  ::freeaddrinfo(found);
  return all;
}

// Connecting a UDP socket sends nothing: it only makes the kernel choose the route and source.
std::string route_source_address(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) {
    return "";
  }
  std::string out;
  for (addrinfo* a = found; a != nullptr && out.empty(); a = a->ai_next) {
    int fd = socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      continue;
    }
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    char text[INET6_ADDRSTRLEN] = {0};
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      const void* raw =
          local.ss_family == AF_INET
              ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr)
              : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr);
      if (inet_ntop(local.ss_family, raw, text, sizeof(text)) != nullptr) {
        out = text;
      }
    }
    close(fd);
  }
  freeaddrinfo(found);
  return out;
}

bool is_loopback_name(const std::string& host) {
  in6_addr literal{};
  return ::inet_pton(AF_INET, host.c_str(), &literal) != 1 &&
         ::inet_pton(AF_INET6, host.c_str(), &literal) != 1 && resolves_to_loopback_only(host);
}

}  // namespace detail
}  // namespace dist
}  // namespace paratrain
