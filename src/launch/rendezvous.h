#pragma once

// Internal: the dynamic rendezvous of `paratrain launch --rdzv-endpoint host:port --rdzv-id JOB`
// (torchrun's c10d rendezvous). The launchers of a job meet in paratrain's store (socket_store.h)
// on the endpoint, served, on the endpoint's address only, by the launcher on the endpoint's host.
//
// Note [Rendezvous rounds]
// Membership is decided in rounds. Joining round r takes a ticket (an atomic add); ticket k makes
// the node node rank k-1. The first ticket holder closes the round: at once when max nodes have
// joined, or `last_call` after min nodes have (so late arrivals still make it), and fails it if
// min nodes have not joined by `join_timeout`. A node whose ticket comes after the close (or
// past max) waits as a standby and is counted, which makes the running nodes open round r+1 when
// the world can grow: it is taken in at that restart. A node whose workers fail, or that sees
// another node's heartbeat stop, opens round r+1 too; every node's monitor then sees the new
// round, stops its workers, and joins it. Node 0 of a round picks the workers' MASTER_ADDR (its
// address toward the endpoint) and MASTER_PORT. Keys live under the job's id, so jobs with other
// ids on one endpoint never mix, and a job with the same id but another command or node shape is
// refused. A job's keys live under a generation of its id: a job that ends (all its nodes done,
// or one node giving up) moves the id to the next generation, so a later run with the same id
// starts clean. A node that gives up (out of restarts, interrupted) writes why under "shutdown",
// and every other node of the job stops with that reason instead of waiting for a round that
// cannot form.
//
// Note [Partitions and dead nodes]
// A node is taken for dead or unreachable only when its heartbeat has stood still for the
// keep-alive time, never after one failed call. What happens then depends on why:
// - Its launcher ended (killed, or its host reset the connection): its key "alive<n>", set as an
//   ephemeral key on its connection to the store, is gone with that connection. A static job
//   ends at once (it cannot go on without the node); a dynamic one forms a new round without it.
// - It cannot be reached (a network partition, a host that stopped): its connection is still
//   open, so the key stays. The others open a new round and wait for it (the join timeout): an
//   agreed restart, which a static job counts against max_restarts. On its side, the node rides
//   out a store that does not answer for the keep-alive time, then stops its workers too and
//   keeps trying to reach the store (the join timeout); once it answers, the node joins that
//   round (opening it, if nobody did).
// A partition shorter than the keep-alive time, less the second or two a node needs to reconnect,
// passes with no restart. The same rules hold on the node serving the store, whose own calls
// never fail. A store call that finds no server at all (refused, closed) is the serving node's end:
// the connection is not used again, and next() reports it.

#include "rendezvous_keys.h"
#include "rendezvous_policy.h"
#include "rendezvous_store.h"

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace paratrain {
namespace dist {
namespace detail {

/// How long a stalled node's connection must stay closed before it counts as ended rather than
/// reconnecting (Note [Partitions and dead nodes]).
constexpr std::chrono::milliseconds kEndedGrace{2000};

struct RendezvousOptions {
  std::string host;  // the endpoint
  int port = 29400;
  /// The address this node gives the others (--local-addr); "" finds the one that routes to the
  /// endpoint.
  std::string local_addr;
  std::string id;
  int min_nodes = 1;
  int max_nodes = 1;
  std::chrono::milliseconds join_timeout{600000};
  std::chrono::milliseconds last_call{30000};
  /// A node whose heartbeat has not moved for this long is taken for dead.
  std::chrono::milliseconds keep_alive{10000};
  /// What every node of the job must agree on (command, processes per node, min:max).
  std::string signature;
  /// "c10d": paratrain's store, served by the launcher on the endpoint's host; "etcd": an etcd
  /// server at the endpoint (its v3 API), which outlives any node.
  std::string backend = "c10d";
  /// Static rendezvous (--node-rank) with restarts agreed across nodes: this node's fixed rank
  /// (-1: ranks in the order nodes join), node 0 serves the store, and every round's workers
  /// meet at `fixed_master` ("addr:port", the job's --master-addr and --master-port).
  int fixed_node_rank = -1;
  std::string fixed_master;
  /// Static: the rounds after the first are the job's restarts; one beyond this ends the job.
  int max_restarts = 0;
};

struct Assignment {
  int64_t round = 0;
  int node_rank = 0;
  int nnodes = 1;
  std::string master_addr;
  int master_port = 0;
};

class Rendezvous {
 public:
  /// Opens the store (serving it when the endpoint is this host's address and nobody here serves
  /// it yet) and checks the job's signature. Throws c10::Error with one line.
  explicit Rendezvous(RendezvousOptions options);
  /// Over a store opened elsewhere (an in-memory one in the tests); the mode's policy as above.
  Rendezvous(RendezvousOptions options, std::unique_ptr<RendezvousStore> store);
  ~Rendezvous();

  /// Joins the open round and returns this node's place once the round closes; waits as a
  /// standby when it comes too late. Throws c10::Error naming the endpoint, the id and how many
  /// nodes joined when min nodes do not join within the join timeout.
  Assignment next();
  /// Called about twice a second while the workers run: beats this node's heartbeat, and says
  /// whether the workers must stop for a new round (one opened; a standby waits and the world
  /// can grow; a node's heartbeat stopped). The reason goes to `why`.
  bool must_restart(const Assignment& a, std::string* why, bool* membership = nullptr);
  /// After this node's workers failed: whether the membership changed (a new round opened, or a
  /// node's heartbeat stops within `wait`), which explains the failure (peers that die take the
  /// survivors' collectives with them). The reason goes to `why`.
  bool membership_changed(const Assignment& a, std::chrono::milliseconds wait, std::string* why);
  /// Opens round a.round + 1 unless someone already did. `membership`: for a change of members
  /// (a dead node, a standby), which does not count against other nodes' restarts; else for this
  /// node's failure.
  void open_next_round(const Assignment& a, const std::string& reason);
  /// This node gives up (`why`): the other nodes stop too, and the id moves to a new generation.
  /// `others`: how many other nodes should read it before the node serving the store leaves.
  void shut_down(const std::string& why, int others);
  /// This node's workers finished: the node serving the store keeps it up until every node of
  /// the round says so (or `linger` passes), so that the others' last calls reach it.
  void finish(const Assignment& a, std::chrono::milliseconds linger);

  const RendezvousOptions& options() const { return o_; }
  /// Whether this node saw (or made) the job end: it joins no further round.
  bool job_ended() const { return shutdown_seen_; }

 private:
  RendezvousKeys keys() const { return {o_.id, generation_}; }  // under this run's generation
  void check_shutdown(bool may_move = false);
  void note_shutdown_seen();
  int64_t read_int(const std::string& k);
  std::string describe() const;
  bool close_round(int64_t round);
  bool wait_closed(int64_t round);
  std::string get_or(const std::string& k, const std::string& fallback);
  void wait_standby(int64_t round);

  RendezvousOptions o_;
  std::unique_ptr<RendezvousPolicy> policy_;  // what differs between c10d, etcd and static
  void start();
  void next_generation();
  void skip_dead_generation();
  bool peer_stopped(const Assignment& a, std::string* why, bool& dead_peer);
  bool peer_ended(const Assignment& a, int n);
  bool peer_unreachable(const Assignment& a, const std::string& who, std::string* why);
  bool store_failed(const Assignment& a, const std::exception& e, std::string* why);
  Assignment join();
  int64_t draw_ticket(int64_t round);
  bool round_moved(int64_t round);
  void open_pending_round();
  std::string me() const;

  std::unique_ptr<RendezvousStore> store_;
  bool serving_ = false;
  bool admitted_ = false;  // this node has taken part in a round of its generation
  std::string broken_;     // why the connection to the store failed ("" while it works)
  int64_t generation_ = 0;
  std::string my_address_;
  std::vector<int64_t> last_beats_;
  std::vector<std::chrono::steady_clock::time_point> last_moved_;
  // Since when a stalled node's "alive" key is missing (its launcher's connection closed); the
  // epoch while it is there.
  std::vector<std::chrono::steady_clock::time_point> ended_since_;
  std::chrono::steady_clock::time_point last_contact_{};  // the store's last answer
  // A round this node left while the store did not answer, and why ("unreachable", "failure"): the
  // next round opens once it answers (next()).
  struct PendingRound {
    Assignment left;
    std::string reason;
    std::string why;  // what must_restart says while it waits
  };
  std::optional<PendingRound> pending_;
  std::string joined_;  // the count key of the round whose ticket this node holds in next()
  int64_t joined_ticket_ = 0;
  // A round in which this node drew a ticket whose reply never came (join()).
  std::optional<int64_t> abandoned_;
  std::chrono::steady_clock::time_point retry_after_{};  // etcd: no call before (after a failure)
  bool shutdown_seen_ = false;  // this node counted itself in shutdown_seen, or ended the job
  bool node0_done_ = false;     // static: node 0's workers finished (its store may go)
};

}  // namespace detail
}  // namespace dist
}  // namespace paratrain
