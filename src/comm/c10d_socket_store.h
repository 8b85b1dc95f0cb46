#pragma once

// Internal: paratrain's store (socket_store.h) as a c10d::Store, the interface Gloo and NCCL
// take, as they would take c10d's TCPStore.

#include "store/socket_store.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace paratrain {
namespace dist {
namespace detail {

/// SocketStore's client (and with `serve`, its server) behind c10d::Store. Each call runs with
/// the c10d::Store's own timeout (setTimeout), which c10d's callers change as they go.
class C10dSocketStore : public c10d::Store {
 public:
  C10dSocketStore(const std::string& host, int port, bool serve, std::chrono::milliseconds timeout);
  explicit C10dSocketStore(std::unique_ptr<SocketStore> client);

  /// The port served or connected to.
  int port() const { return client_->port(); }

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
  // The client, with this store's current timeout.
  SocketStore& client();

  std::unique_ptr<SocketStore> client_;
};

}  // namespace detail
}  // namespace dist
}  // namespace paratrain
