#include "socket_store.h"

#include "store_server.h"
#include "store_wire.h"

#include <c10/util/Exception.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

namespace paratrain {
namespace dist {
namespace detail {

using namespace store_wire;  // the wire's names: this file's vocabulary

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

}  // namespace detail
}  // namespace dist
}  // namespace paratrain
