// paratrain's store (src/store/socket_store.h), through its c10d::Store face: c10d::Store's
// semantics, the addresses its server binds, and a deadline on every call. Real sockets on
// loopback.

#include "store/socket_store.h"
#include "comm/c10d_socket_store.h"
#include "paratrain/store/host_address.h"
#include "test_util.h"  // error_of

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <thread>

namespace paratrain {
namespace testing {
namespace {

using SocketStore = dist::detail::C10dSocketStore;  // the store as Gloo and NCCL use it
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

std::vector<uint8_t> v(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

std::string s(const std::vector<uint8_t>& v) {
  return std::string(v.begin(), v.end());
}

c10::intrusive_ptr<SocketStore> serve(const std::string& host = "127.0.0.1",
                                      milliseconds timeout = milliseconds(5000)) {
  return c10::make_intrusive<SocketStore>(host, 0, /*serve=*/true, timeout);
}

c10::intrusive_ptr<SocketStore> connect(const SocketStore& server,
                                        const std::string& host = "127.0.0.1",
                                        milliseconds timeout = milliseconds(5000)) {
  return c10::make_intrusive<SocketStore>(host, server.port(), /*serve=*/false, timeout);
}

// Whether a TCP connection to host:port is accepted.
bool accepts(const std::string& host, int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, host.c_str(), &addr.sin_addr);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return ok;
}

TEST(SocketStore, CloneIsAnotherClientOfTheSameServer) {
  // TCPStore::clone's contract (libtorch 2.7 made Store::clone() pure virtual): a new connection
  // to the same keys, with the same timeout, that outlives the store it was cloned from.
  auto server = serve("127.0.0.1", milliseconds(1500));
  auto client = connect(*server);
  c10::intrusive_ptr<c10d::Store> copy = client->clone();
  ASSERT_TRUE(copy);
  EXPECT_NE(copy.get(), static_cast<c10d::Store*>(client.get()));
  copy->set("from-clone", v("x"));
  EXPECT_EQ(s(client->get("from-clone")), "x");
  EXPECT_EQ(copy->getTimeout(), client->getTimeout());
  client.reset();
  EXPECT_EQ(copy->add("counter", 2), 2);
}

TEST(SocketStore, KeepsC10dStoreSemantics) {
  auto server = serve();
  auto client = connect(*server);
  client->set("a", v("1"));
  EXPECT_EQ(s(server->get("a")), "1");
  EXPECT_EQ(client->add("n", 5), 5);  // a missing key counts from 0
  EXPECT_EQ(server->add("n", -2), 3);
  EXPECT_EQ(s(client->get("n")), "3");  // add keeps decimal text, as TCPStore
  EXPECT_TRUE(client->check({"a", "n"}));
  EXPECT_FALSE(client->check({"a", "missing"}));
  // compareSet: a missing key is made only from an empty `expected`; the answer is the value after.
  EXPECT_EQ(s(client->compareSet("c", v("x"), v("y"))), "x");
  EXPECT_FALSE(client->check({"c"}));
  EXPECT_EQ(s(client->compareSet("c", v(""), v("y"))), "y");
  EXPECT_EQ(s(client->compareSet("c", v("z"), v("w"))), "y");
  EXPECT_EQ(s(client->compareSet("c", v("y"), v("w"))), "w");
  EXPECT_EQ(client->getNumKeys(), 3);
  EXPECT_TRUE(client->deleteKey("c"));
  EXPECT_FALSE(client->deleteKey("c"));
  EXPECT_EQ(client->getNumKeys(), 2);
  client->set("a", v("not a number"));
  EXPECT_NE(error_of([&] { client->add("a", 1); }).find("does not hold an integer"),
            std::string::npos);
  // Binary values of any size travel whole.
  std::vector<uint8_t> big(3 << 20);
  for (size_t i = 0; i < big.size(); ++i) {
    big[i] = static_cast<uint8_t>(i * 7);
  }
  client->set("big", big);
  EXPECT_EQ(server->get("big"), big);
}

TEST(SocketStore, GetAndWaitHoldUntilAnotherClientSets) {
  auto server = serve();
  auto waiter = connect(*server);
  std::thread setter([&] {
    auto c = connect(*server);
    std::this_thread::sleep_for(milliseconds(300));
    c->set("k", v("v"));
    c->set("k2", v("v2"));
  });
  const auto t0 = Clock::now();
  EXPECT_EQ(s(waiter->get("k")), "v");
  waiter->wait({"k", "k2"}, milliseconds(5000));
  setter.join();
  EXPECT_GE(Clock::now() - t0, milliseconds(250));
}

TEST(SocketStore, TimeoutsNameTheKeysAndLeaveTheConnectionUsable) {
  auto server = serve();
  auto client = connect(*server, "127.0.0.1", milliseconds(400));
  auto t0 = Clock::now();
  const std::string why = error_of([&] { client->get("never"); });
  EXPECT_NE(why.find("timed out after 400 ms waiting for key 'never' in the store at 127.0.0.1:" +
                     std::to_string(server->port())),
            std::string::npos)
      << why;
  EXPECT_LT(Clock::now() - t0, milliseconds(3000));
  EXPECT_NE(error_of([&] {
              client->wait({"x", "y"}, milliseconds(100));
            }).find("timed out after 100 ms waiting for keys 'x', 'y'"),
            std::string::npos);
  client->set("after", v("ok"));
  EXPECT_EQ(s(client->get("after")), "ok");
}

// kNoTimeout and limits too large to add to a clock both mean no limit, not an instant timeout.
// The calls run on another thread, so that a regression fails here instead of hanging.
TEST(SocketStore, UnlimitedTimeoutsWait) {
  for (auto timeout : {c10d::Store::kNoTimeout, milliseconds::max()}) {
    auto server = serve("127.0.0.1", timeout);
    auto waiter = std::async(std::launch::async, [&] {
      const std::string got = s(server->get("late"));
      server->wait({"late"}, timeout);
      return got;
    });
    std::this_thread::sleep_for(milliseconds(200));
    EXPECT_EQ(waiter.wait_for(milliseconds(0)), std::future_status::timeout);  // still held
    connect(*server)->set("late", v("x"));
    ASSERT_EQ(waiter.wait_for(std::chrono::seconds(10)), std::future_status::ready);
    EXPECT_EQ(waiter.get(), "x");
    EXPECT_EQ(server->add("n", 1), 1);
  }
}

TEST(SocketStore, ServesOnlyTheAddressesItsHostNames) {
  auto local = serve("127.0.0.1");
  EXPECT_TRUE(accepts("127.0.0.1", local->port()));
  EXPECT_FALSE(accepts("127.0.0.2", local->port()));  // c10d's TCPStore accepts here too
  // The same probe sees a server on every address: the check above could fail.
  auto everywhere = serve("0.0.0.0");
  EXPECT_TRUE(accepts("127.0.0.2", everywhere->port()));
  EXPECT_TRUE(dist::resolves_to_loopback_only("127.0.1.1"));
  EXPECT_TRUE(dist::resolves_to_loopback_only("localhost"));
  EXPECT_FALSE(dist::resolves_to_loopback_only("10.77.0.1"));
}

TEST(SocketStore, PortInUseAndUnreachableServerAreOneLine) {
  auto first = serve();
  const std::string in_use = error_of(
      [&] { SocketStore second("127.0.0.1", first->port(), /*serve=*/true, milliseconds(1000)); });
  EXPECT_NE(in_use.find("failed to bind 127.0.0.1:" + std::to_string(first->port()) +
                        ": Address already in use"),
            std::string::npos)
      << in_use;
  const int port = first->port();
  first.reset();
  auto t0 = Clock::now();
  const std::string refused =
      error_of([&] { SocketStore client("127.0.0.1", port, /*serve=*/false, milliseconds(500)); });
  EXPECT_NE(refused.find("cannot connect to 127.0.0.1:" + std::to_string(port) +
                         " within 500 ms: Connection refused"),
            std::string::npos)
      << refused;
  EXPECT_LT(Clock::now() - t0, milliseconds(3000));
}

TEST(SocketStore, ACallFailsWhenTheServerExits) {
  auto server = serve();
  auto client = connect(*server, "127.0.0.1", milliseconds(20000));
  std::thread stopper([&] {
    std::this_thread::sleep_for(milliseconds(300));
    server.reset();
  });
  auto t0 = Clock::now();
  const std::string why = error_of([&] { client->get("never"); });
  stopper.join();
  EXPECT_NE(why.find("the server closed the connection"), std::string::npos) << why;
  EXPECT_LT(Clock::now() - t0, milliseconds(5000));
}

// A listening socket on loopback that accepts (in the kernel's backlog) but never answers, as a
// hung process: its port goes to `port`. Close the returned descriptor.
int silent_listener(int& port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  EXPECT_EQ(::listen(fd, 4), 0);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  port = ntohs(addr.sin_port);
  return fd;
}

// A peer that accepts but never answers (a hung process): even set and add end at the store's
// timeout, where c10d's TCPStore would wait forever.
TEST(SocketStore, EveryCallHasADeadline) {
  int port = 0;
  const int fd = silent_listener(port);
  SocketStore client("127.0.0.1", port, /*serve=*/false, milliseconds(300));
  auto t0 = Clock::now();
  const std::string why = error_of([&] { client.add("k", 1); });
  EXPECT_NE(why.find("add to key 'k' on the store at 127.0.0.1:"), std::string::npos) << why;
  EXPECT_NE(why.find("no reply within 300 ms"), std::string::npos) << why;
  EXPECT_LT(Clock::now() - t0, milliseconds(3000));
  ::close(fd);
}

// Ephemeral keys (setEphemeral) live as long as the connection that set them last: the launchers'
// rendezvous tells a node whose launcher ended (its key gone) from one it cannot reach.
TEST(SocketStore, EphemeralKeysGoWithTheirConnection) {
  using Raw = dist::detail::SocketStore;
  Raw server("127.0.0.1", 0, /*serve=*/true, milliseconds(5000));
  auto client = [&] {
    return std::make_unique<Raw>("127.0.0.1", server.port(), false, milliseconds(5000));
  };
  auto a = client();
  auto b = client();
  auto c = client();
  a->setEphemeral("alive", v("1"));
  b->setEphemeral("made-permanent", v("x"));
  a->set("made-permanent", v("y"));  // a plain set: the key outlives b
  b->setEphemeral("moved", v("1"));
  c->setEphemeral("moved", v("2"));  // c's now: b's end leaves it
  EXPECT_TRUE(server.check({"alive"}));
  // Whether `key` is gone within two seconds (the server sees a closed connection at its pace).
  auto gone = [&](const std::string& key) {
    for (int i = 0; i < 200 && server.check({key}); ++i) {
      std::this_thread::sleep_for(milliseconds(10));
    }
    return !server.check({key});
  };
  a.reset();
  b.reset();
  EXPECT_TRUE(gone("alive"));
  std::this_thread::sleep_for(milliseconds(200));
  EXPECT_TRUE(server.check({"made-permanent"}));
  EXPECT_EQ(s(server.get("made-permanent")), "y");
  EXPECT_TRUE(server.check({"moved"}));
  EXPECT_EQ(s(server.get("moved")), "2");
  c.reset();
  EXPECT_TRUE(gone("moved"));
}

// lastFailure() tells a server that is gone (closed, refused) from one that does not answer (a
// partition, a hung host), which the rendezvous rides out.
TEST(SocketStore, FailuresSayWhetherTheServerIsGoneOrUnreachable) {
  using Raw = dist::detail::SocketStore;
  auto server = std::make_unique<Raw>("127.0.0.1", 0, /*serve=*/true, milliseconds(5000));
  Raw client("127.0.0.1", server->port(), /*serve=*/false, milliseconds(500));
  client.add("k", 1);
  EXPECT_EQ(client.lastFailure(), Raw::Failure::kNone);
  EXPECT_NE(error_of([&] { client.wait({"never"}, milliseconds(100)); }), "");
  EXPECT_EQ(client.lastFailure(), Raw::Failure::kNone) << "the server answered: timed out";
  server.reset();
  EXPECT_NE(error_of([&] { client.add("k", 1); }), "");
  EXPECT_EQ(client.lastFailure(), Raw::Failure::kGone) << "closed by the server's end";
  EXPECT_NE(error_of([&] { client.add("k", 1); }).find("Connection refused"), std::string::npos);
  EXPECT_EQ(client.lastFailure(), Raw::Failure::kGone) << "refused";
  // A peer that accepts but never answers.
  int port = 0;
  const int fd = silent_listener(port);
  Raw silent("127.0.0.1", port, /*serve=*/false, milliseconds(300));
  EXPECT_NE(error_of([&] { silent.add("k", 1); }).find("no reply within 300 ms"),
            std::string::npos);
  EXPECT_EQ(silent.lastFailure(), Raw::Failure::kUnreachable);
  ::close(fd);
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
