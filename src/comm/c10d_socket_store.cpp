#include "c10d_socket_store.h"

namespace paratrain {
namespace dist {
namespace detail {

C10dSocketStore::C10dSocketStore(const std::string& host,
                                 int port,
                                 bool serve,
                                 std::chrono::milliseconds timeout)
    : C10dSocketStore(std::make_unique<SocketStore>(host, port, serve, timeout)) {}

C10dSocketStore::C10dSocketStore(std::unique_ptr<SocketStore> client)
    : c10d::Store(client->getTimeout()), client_(std::move(client)) {}

SocketStore& C10dSocketStore::client() {
  // c10d's callers set timeout_ through setTimeout, and wrappers such as PrefixStore set it on
  // the store they wrap: each call takes it as it is then.
  client_->setTimeout(timeout_);
  return *client_;
}

void C10dSocketStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  client().set(key, value);
}

std::vector<uint8_t> C10dSocketStore::compareSet(const std::string& key,
                                                 const std::vector<uint8_t>& expected,
                                                 const std::vector<uint8_t>& desired) {
  return client().compareSet(key, expected, desired);
}

std::vector<uint8_t> C10dSocketStore::get(const std::string& key) {
  return client().get(key);
}

int64_t C10dSocketStore::add(const std::string& key, int64_t value) {
  return client().add(key, value);
}

bool C10dSocketStore::deleteKey(const std::string& key) {
  return client().deleteKey(key);
}

bool C10dSocketStore::check(const std::vector<std::string>& keys) {
  return client().check(keys);
}

int64_t C10dSocketStore::getNumKeys() {
  return client().getNumKeys();
}

void C10dSocketStore::wait(const std::vector<std::string>& keys) {
  client().wait(keys);
}

void C10dSocketStore::wait(const std::vector<std::string>& keys,
                           const std::chrono::milliseconds& timeout) {
  client().wait(keys, timeout);
}

c10::intrusive_ptr<c10d::Store> C10dSocketStore::clone() {
  return c10::make_intrusive<C10dSocketStore>(client().clone());
}

}  // namespace detail
}  // namespace dist
}  // namespace paratrain
