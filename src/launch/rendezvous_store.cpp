// The two kinds of rendezvous store (rendezvous_store.h): paratrain's socket store, and etcd
// through its v3 JSON gateway on cpp-httplib.

#include "rendezvous_store.h"

#include "base/errors.h"
#include "store/socket_store.h"

#include <c10/util/Exception.h>

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#ifdef PARATRAIN_WITH_ETCD
#include <httplib.h>
#include <nlohmann/json.hpp>
#endif

namespace paratrain {
namespace dist {
namespace detail {
namespace {

std::vector<uint8_t> bytes(const std::string& s) {
  return {s.begin(), s.end()};
}

std::string text(const std::vector<uint8_t>& b) {
  return {b.begin(), b.end()};
}

class SocketRendezvousStore : public RendezvousStore {
 public:
  explicit SocketRendezvousStore(std::unique_ptr<SocketStore> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::string& value) override {
    store_->set(key, bytes(value));
  }
  std::string compare_set(const std::string& key,
                          const std::string& expected,
                          const std::string& desired) override {
    return text(store_->compareSet(key, bytes(expected), bytes(desired)));
  }
  std::optional<std::string> get(const std::string& key) override {
    if (!store_->check({key})) {
      return std::nullopt;
    }
    return text(store_->get(key));
  }
  int64_t add(const std::string& key, int64_t delta) override { return store_->add(key, delta); }
  void set_ephemeral(const std::string& key, const std::string& value) override {
    store_->setEphemeral(key, bytes(value));
  }
  bool ephemeral_kept() const override { return true; }
  bool last_call_unreachable() const override {
    return store_->lastFailure() == SocketStore::Failure::kUnreachable;
  }
  bool last_call_found_none() const override {
    return store_->lastFailure() == SocketStore::Failure::kGone;
  }

 private:
  std::unique_ptr<SocketStore> store_;
};

}  // namespace

std::unique_ptr<RendezvousStore> open_socket_store(const std::string& host,
                                                   int port,
                                                   bool serve,
                                                   std::chrono::milliseconds connect_timeout,
                                                   std::chrono::milliseconds call_timeout) {
  auto store = std::make_unique<SocketStore>(host, port, serve, connect_timeout);
  store->setTimeout(call_timeout);
  return std::make_unique<SocketRendezvousStore>(std::move(store));
}

namespace {

// Why a TCP connection to host:port fails ("" when it opens): the text a user can act on
// (Connection refused, No route to host), which an HTTP library's error codes do not carry.
std::string tcp_failure(const std::string& host, int port, std::chrono::milliseconds timeout) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (rc != 0) {
    return std::string("the host does not resolve: ") + gai_strerror(rc);
  }
  std::string why = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      why = std::strerror(errno);
      continue;
    }
    int err = connect(fd, a->ai_addr, a->ai_addrlen) == 0 ? 0 : errno;
    if (err == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      err = poll(&p, 1, static_cast<int>(timeout.count())) == 1 ? 0 : ETIMEDOUT;
      socklen_t len = sizeof(err);
      if (err == 0) {
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      }
    }
    close(fd);
    if (err == 0) {
      freeaddrinfo(found);
      return "";
    }
    why = std::strerror(err);
  }
  freeaddrinfo(found);
  return why;
}

}  // namespace

#ifdef PARATRAIN_WITH_ETCD

namespace {

using Json = nlohmann::json;

// etcd's JSON gateway carries keys and values as base64. Written here: neither the C++ library
// nor c10 has a decoder, and cpp-httplib's encoder is internal to it.
constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

std::string base64(const std::string& in) {
  std::string out;
  uint32_t bits = 0;
  int count = 0;
  for (unsigned char c : in) {
    bits = (bits << 8) | c;
    count += 8;
    while (count >= 6) {
      count -= 6;
      out += kAlphabet[(bits >> count) & 63];
    }
  }
  if (count > 0) {
    out += kAlphabet[(bits << (6 - count)) & 63];
  }
  while (out.size() % 4 != 0) {
    out += '=';
  }
  return out;
}

std::string unbase64(const std::string& in) {
  std::string out;
  uint32_t bits = 0;
  int count = 0;
  for (char c : in) {
    const char* at = c == '\0' ? nullptr : std::strchr(kAlphabet, c);
    if (at == nullptr) {
      continue;  // '=' padding
    }
    bits = (bits << 6) | static_cast<uint32_t>(at - kAlphabet);
    count += 6;
    if (count >= 8) {
      count -= 8;
      out += static_cast<char>((bits >> count) & 255);
    }
  }
  return out;
}

class EtcdStore : public RendezvousStore {
 public:
  EtcdStore(std::string host, int port, std::chrono::milliseconds call_timeout)
      : host_(std::move(host)), port_(port), client_(host_, port_) {
    const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(call_timeout).count();
    client_.set_connection_timeout(seconds);
    client_.set_read_timeout(seconds);
    client_.set_write_timeout(seconds);
    client_.set_keep_alive(true);  // the rendezvous polls twice a second: one connection
  }

  // Checks that etcd answers: a range request must come back as etcd's JSON, with its header.
  void probe() {
    const auto r =
        client_.Post("/v3/kv/range", Json{{"key", base64("paratrain")}}.dump(), "application/json");
    TORCH_CHECK(r, "--rdzv-endpoint ", where(),
                ": the connection opened, but no HTTP answer came (", httplib::to_string(r.error()),
                "): this is not etcd's client port; give etcd's address (port 2379 by default)");
    Json j;
    try {
      j = Json::parse(r->body);
    } catch (const Json::exception&) {
    }
    const bool etcd = r->status == 200 && j.is_object() && j.contains("header") &&
                      j["header"].is_object() && j["header"].contains("cluster_id");
    TORCH_CHECK(etcd, "--rdzv-endpoint ", where(), ": the server there is not etcd (it answered ",
                "etcd's v3 range request with HTTP ", r->status, ": ", first_line(r->body),
                "); give etcd's client address (port 2379 by default)");
  }

  void set(const std::string& key, const std::string& value) override {
    call("/v3/kv/put", Json{{"key", base64(key)}, {"value", base64(value)}});
  }

  std::optional<std::string> get(const std::string& key) override {
    return first_value(call("/v3/kv/range", Json{{"key", base64(key)}}));
  }

  std::string compare_set(const std::string& key,
                          const std::string& expected,
                          const std::string& desired) override {
    const Json compare =
        expected.empty()
            ? Json{{"key", base64(key)}, {"target", "CREATE"}, {"create_revision", "0"}}
            : Json{{"key", base64(key)}, {"target", "VALUE"}, {"value", base64(expected)}};
    const Json j = transaction(compare, key, desired);
    if (j.value("succeeded", false)) {
      return desired;
    }
    // As c10d: an absent key with a non-empty `expected` is left absent and `expected` returned.
    // (The gateway leaves out what is empty: no "kvs" for an absent key.)
    const std::optional<std::string> now =
        first_value(j.value("/responses/0/response_range"_json_pointer, Json::object()));
    return now ? *now : expected;
  }

  int64_t add(const std::string& key, int64_t delta) override {
    // Read, then write only if nobody wrote in between (the key's revision is unchanged).
    for (;;) {
      const Json j = call("/v3/kv/range", Json{{"key", base64(key)}});
      const std::optional<std::string> value = first_value(j);
      const bool exists = value.has_value();
      const int64_t now = exists ? number(key, *value) : 0;
      if (exists && delta == 0) {
        return now;  // a read (the rendezvous polls its counters so): no write, no revision
      }
      const Json compare =
          exists ? Json{{"key", base64(key)},
                        {"target", "MOD"},
                        {"mod_revision", j.at("kvs").at(0).value("mod_revision", "0")}}
                 : Json{{"key", base64(key)}, {"target", "CREATE"}, {"create_revision", "0"}};
      if (transaction(compare, key, std::to_string(now + delta)).value("succeeded", false)) {
        return now + delta;
      }
    }
  }

  std::string where() const { return host_ + ":" + std::to_string(port_); }

 private:
  // The value of a range response's first key; nullopt when it found none.
  static std::optional<std::string> first_value(const Json& range) {
    const auto kvs = range.find("kvs");
    if (kvs == range.end() || !kvs->is_array() || kvs->empty()) {
      return std::nullopt;
    }
    return unbase64((*kvs)[0].value("value", ""));  // "" for an empty value, which it leaves out
  }

  int64_t number(const std::string& key, const std::string& text) const {
    TORCH_CHECK(!text.empty() && text.size() <= 19 &&
                    text.find_first_not_of("-0123456789") == std::string::npos,
                "etcd at ", where(), ": key ", key, " holds '", text, "', not a counter");
    return std::stoll(text);
  }

  static std::string first_line(const std::string& body) {
    std::string line = body.substr(0, body.find('\n'));
    return line.size() > 80 ? line.substr(0, 80) + "..." : line;
  }

  // Puts `value` at `key` if `compare` holds; else reads the key.
  Json transaction(const Json& compare, const std::string& key, const std::string& value) {
    return call(
        "/v3/kv/txn",
        Json{{"compare", Json::array({compare})},
             {"success", Json::array({Json{
                             {"request_put", {{"key", base64(key)}, {"value", base64(value)}}}}})},
             {"failure", Json::array({Json{{"request_range", {{"key", base64(key)}}}}})}});
  }

  Json call(const std::string& path, const Json& body) {
    const auto r = client_.Post(path.c_str(), body.dump(), "application/json");
    TORCH_CHECK(r, "etcd at ", where(), ": ", path, " failed (", httplib::to_string(r.error()),
                ")");
    Json j;
    try {
      j = Json::parse(r->body);
    } catch (const Json::exception&) {
      TORCH_CHECK(false, "etcd at ", where(), ": ", path, " answered HTTP ", r->status,
                  " with something other than JSON: ", first_line(r->body));
    }
    TORCH_CHECK(r->status == 200 && !j.contains("error"), "etcd at ", where(), ": ", path,
                " answered HTTP ", r->status, ": ", first_line(r->body));
    return j;
  }

  std::string host_;
  int port_;
  httplib::Client client_;
};

}  // namespace

std::unique_ptr<RendezvousStore> open_etcd_store(const std::string& host,
                                                 int port,
                                                 std::chrono::milliseconds connect_timeout,
                                                 std::chrono::milliseconds call_timeout) {
  const auto deadline = std::chrono::steady_clock::now() + connect_timeout;
  for (;;) {
    const std::string why = tcp_failure(host, port, std::chrono::milliseconds(2000));
    if (why.empty()) {
      break;
    }
    TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "--rdzv-endpoint ", host, ":", port,
                ": cannot reach etcd within ", connect_timeout.count() / 1000.0, " s (", why,
                "); start etcd there (Debian's etcd-server) or fix the address");
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  auto store = std::make_unique<EtcdStore>(host, port, call_timeout);
  store->probe();
  return store;
}

#else

std::unique_ptr<RendezvousStore> open_etcd_store(const std::string& host,
                                                 int port,
                                                 std::chrono::milliseconds,
                                                 std::chrono::milliseconds) {
  (void)tcp_failure;
  TORCH_CHECK(false, "--rdzv-backend etcd: this build of paratrain has no HTTP client to reach ",
              host, ":", port, "; rebuild it with cpp-httplib (Debian's libcpp-httplib-dev)");
}

#endif

}  // namespace detail
}  // namespace dist
}  // namespace paratrain
