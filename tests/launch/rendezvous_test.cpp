// The rendezvous' rounds and each mode's policy, over an in-memory store: several nodes in one
// process, each its own thread and its own client of the store, as launchers on several hosts
// are. The end-to-end runs over real stores and launchers are in multihost_test.cpp.

#include "launch/rendezvous.h"
#include "launch/rendezvous_policy.h"
#include "test_util.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace paratrain {
namespace dist {
namespace detail {
namespace {

using namespace std::chrono_literals;
using paratrain::testing::error_of;

// What every client of one in-memory store shares.
struct MemoryState {
  std::mutex mu;
  std::map<std::string, std::string> values;
  std::map<std::string, int> ephemeral_owner;  // key -> the client whose end removes it
  int clients = 0;
};

// A client of the in-memory store with c10d's Store semantics. With `ephemeral`, keys set by
// set_ephemeral go when this client does, as the socket store's go with their connection.
class MemoryStore : public RendezvousStore {
 public:
  MemoryStore(std::shared_ptr<MemoryState> state, bool ephemeral)
      : state_(std::move(state)), ephemeral_(ephemeral) {
    std::lock_guard<std::mutex> lock(state_->mu);
    id_ = ++state_->clients;
  }
  ~MemoryStore() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    for (auto it = state_->ephemeral_owner.begin(); it != state_->ephemeral_owner.end();) {
      if (it->second == id_) {
        state_->values.erase(it->first);
        it = state_->ephemeral_owner.erase(it);
      } else {
        ++it;
      }
    }
  }
  void set(const std::string& key, const std::string& value) override {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->values[key] = value;
  }
  std::string compare_set(const std::string& key,
                          const std::string& expected,
                          const std::string& desired) override {
    std::lock_guard<std::mutex> lock(state_->mu);
    auto it = state_->values.find(key);
    if ((it == state_->values.end() && expected.empty()) ||
        (it != state_->values.end() && it->second == expected)) {
      state_->values[key] = desired;
      return desired;
    }
    return it == state_->values.end() ? expected : it->second;
  }
  std::optional<std::string> get(const std::string& key) override {
    std::lock_guard<std::mutex> lock(state_->mu);
    auto it = state_->values.find(key);
    return it == state_->values.end() ? std::nullopt : std::optional<std::string>(it->second);
  }
  int64_t add(const std::string& key, int64_t delta) override {
    std::lock_guard<std::mutex> lock(state_->mu);
    std::string& v = state_->values[key];
    v = std::to_string((v.empty() ? 0 : std::stoll(v)) + delta);
    return std::stoll(v);
  }
  void set_ephemeral(const std::string& key, const std::string& value) override {
    set(key, value);
    if (ephemeral_) {
      std::lock_guard<std::mutex> lock(state_->mu);
      state_->ephemeral_owner[key] = id_;
    }
  }
  bool ephemeral_kept() const override { return ephemeral_; }

 private:
  std::shared_ptr<MemoryState> state_;
  bool ephemeral_;
  int id_ = 0;
};

RendezvousOptions options(int min_nodes, int max_nodes) {
  RendezvousOptions o;
  o.host = "127.0.0.1";
  o.port = 29400;
  o.id = "job";
  o.min_nodes = min_nodes;
  o.max_nodes = max_nodes;
  o.join_timeout = 10s;
  o.last_call = 100ms;
  o.keep_alive = 300ms;
  o.signature = "train.py 1:2";
  return o;
}

RendezvousOptions static_options(int node_rank, int nodes) {
  RendezvousOptions o = options(nodes, nodes);
  o.fixed_node_rank = node_rank;
  o.fixed_master = "10.1.2.3:29500";
  o.max_restarts = 1;
  return o;
}

std::unique_ptr<Rendezvous> node(const RendezvousOptions& o,
                                 const std::shared_ptr<MemoryState>& state,
                                 bool ephemeral = false) {
  return std::make_unique<Rendezvous>(o, std::make_unique<MemoryStore>(state, ephemeral));
}

// Each node's next(), at once on its own thread.
std::vector<Assignment> meet(std::vector<std::unique_ptr<Rendezvous>>& nodes) {
  std::vector<std::future<Assignment>> joined;
  for (auto& n : nodes) {
    Rendezvous* r = n.get();
    joined.push_back(std::async(std::launch::async, [r] { return r->next(); }));
  }
  std::vector<Assignment> out;
  for (auto& f : joined) {
    out.push_back(f.get());
  }
  return out;
}

// must_restart, asked as the supervisor does, until it says yes or `within` passes.
bool restarts_within(Rendezvous& r,
                     const Assignment& a,
                     std::chrono::milliseconds within,
                     std::string* why,
                     bool* membership = nullptr) {
  const auto deadline = std::chrono::steady_clock::now() + within;
  while (std::chrono::steady_clock::now() < deadline) {
    if (r.must_restart(a, why, membership)) {
      return true;
    }
    std::this_thread::sleep_for(50ms);
  }
  return false;
}

TEST(RendezvousPolicy, EachModeDecidesItsOwn) {
  RendezvousOptions c10d = options(1, 2);
  RendezvousOptions etcd = options(1, 2);
  etcd.backend = "etcd";
  RendezvousOptions fixed = static_options(1, 2);
  const auto p_c10d = make_rendezvous_policy(c10d);
  const auto p_etcd = make_rendezvous_policy(etcd);
  const auto p_static = make_rendezvous_policy(fixed);
  using P = RendezvousPolicy;
  EXPECT_FALSE(p_c10d->store_outlives_nodes());
  EXPECT_TRUE(p_etcd->store_outlives_nodes());
  EXPECT_FALSE(p_static->store_outlives_nodes());
  EXPECT_EQ(p_c10d->on_store_failure(), P::StoreFailure::kRideOut);
  EXPECT_EQ(p_etcd->on_store_failure(), P::StoreFailure::kRetryLater);
  EXPECT_EQ(p_static->on_store_failure(), P::StoreFailure::kRideOut);
  EXPECT_EQ(p_c10d->on_peer_ended(), P::PeerEnded::kNewRound);
  EXPECT_EQ(p_etcd->on_peer_ended(), P::PeerEnded::kNewRound);
  EXPECT_EQ(p_static->on_peer_ended(), P::PeerEnded::kEndJob);
  // A static job's rounds after the first are its restarts: max_restarts 1 allows round 1 only.
  Assignment a;
  a.round = 0;
  EXPECT_TRUE(p_static->restart_left(a));
  a.round = 1;
  EXPECT_FALSE(p_static->restart_left(a));
  a.round = 100;
  EXPECT_TRUE(p_c10d->restart_left(a));
  // Only a static job's nodes other than 0 need node 0's store.
  a.node_rank = 1;
  EXPECT_TRUE(p_static->needs_serving_node(a));
  EXPECT_FALSE(p_c10d->needs_serving_node(a));
  a.node_rank = 0;
  EXPECT_FALSE(p_static->needs_serving_node(a));
  EXPECT_EQ(p_static->round_master("10.9.9.9"), "10.1.2.3:29500");
  EXPECT_EQ(p_c10d->round_master("10.9.9.9").rfind("10.9.9.9:", 0), 0u);
  EXPECT_EQ(p_c10d->how_to_join(), "start them with --rdzv-endpoint 127.0.0.1:29400 --rdzv-id job");
  EXPECT_EQ(p_etcd->how_to_join(),
            "start them with --rdzv-backend etcd --rdzv-endpoint 127.0.0.1:29400 --rdzv-id job");
  EXPECT_EQ(p_static->how_to_join(),
            "start each with its --node-rank, --master-addr 127.0.0.1 and --master-port 29399");
  RendezvousOptions bad = options(1, 1);
  bad.backend = "zookeeper";
  EXPECT_NE(error_of([&] {
              make_rendezvous_policy(bad);
            }).find("unknown rendezvous backend 'zookeeper': use c10d or etcd"),
            std::string::npos);
}

TEST(RendezvousRounds, NodesMeetInOneRoundInTheOrderTheyJoin) {
  auto state = std::make_shared<MemoryState>();
  std::vector<std::unique_ptr<Rendezvous>> nodes;
  for (int i = 0; i < 3; ++i) {
    nodes.push_back(node(options(3, 3), state));
  }
  const std::vector<Assignment> a = meet(nodes);
  std::set<int> ranks;
  for (const auto& x : a) {
    EXPECT_EQ(x.round, 0);
    EXPECT_EQ(x.nnodes, 3);
    EXPECT_EQ(x.master_addr, a[0].master_addr);  // node rank 0 picked it, once for all
    EXPECT_EQ(x.master_port, a[0].master_port);
    ranks.insert(x.node_rank);
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2}));
}

TEST(RendezvousRounds, AnotherJobWithTheSameIdIsRefused) {
  auto state = std::make_shared<MemoryState>();
  auto first = node(options(1, 1), state);
  RendezvousOptions other = options(1, 1);
  other.signature = "eval.py 1:1";
  EXPECT_NE(error_of([&] {
              node(other, state);
            }).find("the id is in use by another job (train.py 1:2; this node: eval.py 1:1)"),
            std::string::npos);
}

TEST(RendezvousRounds, StaticNodesTakeTheirOwnRanksAndTheGivenMaster) {
  auto state = std::make_shared<MemoryState>();
  std::vector<std::unique_ptr<Rendezvous>> nodes;
  nodes.push_back(node(static_options(1, 2), state));
  nodes.push_back(node(static_options(0, 2), state));
  const std::vector<Assignment> a = meet(nodes);
  EXPECT_EQ(a[0].node_rank, 1);
  EXPECT_EQ(a[1].node_rank, 0);
  for (const auto& x : a) {
    EXPECT_EQ(x.nnodes, 2);
    EXPECT_EQ(x.master_addr, "10.1.2.3");
    EXPECT_EQ(x.master_port, 29500);
  }
}

TEST(RendezvousRounds, AWaitingNodeMakesTheJobGrow) {
  auto state = std::make_shared<MemoryState>();
  // The grown round closes last_call after its first node joins: long enough for the waiting
  // node, which polls every 100 ms, to join it too on a loaded machine.
  RendezvousOptions o = options(1, 2);
  o.last_call = 1s;
  auto first = node(o, state);
  const Assignment alone = first->next();  // closes after last_call with one node
  EXPECT_EQ(alone.nnodes, 1);
  auto late = node(o, state);
  auto joined = std::async(std::launch::async, [&] { return late->next(); });
  std::string why;
  ASSERT_TRUE(restarts_within(*first, alone, 5s, &why)) << "the job never grew";
  EXPECT_EQ(why, "1 node waiting to join; the job can grow to 2");
  const Assignment again = first->next();
  const Assignment theirs = joined.get();
  EXPECT_EQ(again.round, 1);
  EXPECT_EQ(theirs.round, 1);
  EXPECT_EQ(again.nnodes, 2);
  EXPECT_EQ(std::set<int>({again.node_rank, theirs.node_rank}), (std::set<int>{0, 1}));
}

// A peer whose heartbeat stands still and whose launcher's keys went (its connection closed):
// a dynamic job forms a new round without it, a static one ends.
TEST(RendezvousRounds, ADeadPeerIsLeftOutOrEndsAStaticJob) {
  for (const bool fixed : {false, true}) {
    SCOPED_TRACE(fixed ? "static" : "c10d");
    auto state = std::make_shared<MemoryState>();
    std::vector<std::unique_ptr<Rendezvous>> nodes;
    for (int i = 0; i < 2; ++i) {
      nodes.push_back(node(fixed ? static_options(i, 2) : options(2, 2), state));
    }
    const std::vector<Assignment> a = meet(nodes);
    const size_t survivor = a[0].node_rank == 0 ? 0 : 1;
    nodes[1 - survivor].reset();  // its launcher ends: no more heartbeats
    std::string why;
    bool membership = false;
    ASSERT_TRUE(restarts_within(*nodes[survivor], a[survivor], 5s, &why, &membership));
    EXPECT_NE(why.find("node 1 (127.0.0.1) stopped its heartbeat"), std::string::npos) << why;
    if (fixed) {
      EXPECT_NE(why.find("a static job cannot go on without it"), std::string::npos) << why;
      EXPECT_TRUE(nodes[survivor]->job_ended());
    } else {
      EXPECT_TRUE(membership);  // the peer's death explains this node's failure
      EXPECT_FALSE(nodes[survivor]->job_ended());
    }
  }
}

// With keys that live as long as a node's connection: a stalled peer whose key is still there is
// unreachable, not dead (a partition: the new round waits for it); once its key has been gone for
// a moment (kEndedGrace), it ended.
TEST(RendezvousRounds, AStalledPeerIsUnreachableUntilItsConnectionCloses) {  // ctest: slow 4
  auto state = std::make_shared<MemoryState>();
  std::vector<std::unique_ptr<Rendezvous>> nodes;
  for (int i = 0; i < 2; ++i) {
    nodes.push_back(node(options(2, 2), state, /*ephemeral=*/true));
  }
  const std::vector<Assignment> a = meet(nodes);
  const size_t survivor = a[0].node_rank == 0 ? 0 : 1;
  std::string why;
  // The peer stays connected and silent: after the keep-alive time it is unreachable.
  ASSERT_TRUE(restarts_within(*nodes[survivor], a[survivor], 3s, &why));
  EXPECT_NE(why.find("its connection is still open (a network partition"), std::string::npos)
      << why;

  auto state2 = std::make_shared<MemoryState>();
  nodes.clear();
  for (int i = 0; i < 2; ++i) {
    nodes.push_back(node(options(2, 2), state2, /*ephemeral=*/true));
  }
  const std::vector<Assignment> b = meet(nodes);
  const size_t alive = b[0].node_rank == 0 ? 0 : 1;
  nodes[1 - alive].reset();  // its connection closes: its keys go
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(restarts_within(*nodes[alive], b[alive], 6s, &why));
  EXPECT_NE(why.find("stopped its heartbeat"), std::string::npos) << why;
  EXPECT_GE(std::chrono::steady_clock::now() - start, kEndedGrace);  // not before the grace
}

TEST(RendezvousRounds, ANodeThatGivesUpStopsTheOthers) {
  auto state = std::make_shared<MemoryState>();
  std::vector<std::unique_ptr<Rendezvous>> nodes;
  for (int i = 0; i < 2; ++i) {
    nodes.push_back(node(options(2, 2), state));
  }
  const std::vector<Assignment> a = meet(nodes);
  nodes[0]->shut_down("no restart left", 1);
  std::string why;
  ASSERT_TRUE(nodes[1]->must_restart(a[1], &why));
  EXPECT_EQ(why, "a node gave up: no restart left");
  EXPECT_TRUE(nodes[1]->job_ended());
  // The id moved to a new generation: a later run with it starts clean.
  auto later = node(options(1, 1), state);
  EXPECT_EQ(later->next().round, 0);
}

}  // namespace
}  // namespace detail
}  // namespace dist
}  // namespace paratrain
