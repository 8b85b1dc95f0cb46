#pragma once

// Internal: what differs between the rendezvous' three modes, each a policy the rendezvous asks
// (rendezvous.h), so that its rounds, heartbeats and shutdown are written once:
// - c10d (--rdzv-backend c10d): paratrain's store, served by the launcher on the endpoint's host;
//   places by the order of joining; a node whose launcher ended is left out of a new round.
// - etcd (--rdzv-backend etcd): an etcd server that outlives the launchers, so a run whose
//   launchers all died is skipped, a round's closer beats while it waits, and a failed call is
//   retried a little later (its HTTP calls are independent).
// - static (--node-rank with restarts agreed across nodes): node 0 serves the store; each node
//   claims its fixed rank; the rounds after the first are the job's counted restarts; the job
//   cannot go on without a node, nor without node 0's store.
// torch.distributed.elastic splits its rendezvous the same way: an operation decides an action
// and an executor applies it; here the policy decides and the rendezvous applies.

#include "rendezvous_keys.h"
#include "rendezvous_store.h"

#include <cstdint>
#include <memory>
#include <string>

namespace paratrain {
namespace dist {
namespace detail {

struct RendezvousOptions;
struct Assignment;

class RendezvousPolicy {
 public:
  /// What a failed heartbeat call means.
  enum class StoreFailure {
    kRetryLater,  // the calls are independent: try again after a moment (etcd)
    kRideOut,     // one connection: ride out a silence up to the keep-alive time (socket store)
  };
  /// What a peer whose launcher ended means for the job.
  enum class PeerEnded {
    kNewRound,  // the others form a new round without it
    kEndJob,    // the job cannot go on without it
  };

  explicit RendezvousPolicy(const RendezvousOptions& options) : o_(options) {}
  virtual ~RendezvousPolicy() = default;

  /// Opens the job's store; `serving`: whether this process serves it. Throws c10::Error with one
  /// line naming the endpoint and the flag that sets it.
  virtual std::unique_ptr<RendezvousStore> open_store(bool* serving) const = 0;
  /// The store outlives the launchers: a run whose launchers all died is skipped at start, and a
  /// round's first node beats while it waits to close it.
  virtual bool store_outlives_nodes() const { return false; }
  virtual StoreFailure on_store_failure() const { return StoreFailure::kRideOut; }
  /// This node's place in `round`, from 1, claimed in the store; 0: by the order of joining.
  virtual int64_t claim_place(RendezvousStore& store,
                              const RendezvousKeys& keys,
                              int64_t round,
                              const std::string& me) const;
  /// The workers' MASTER_ADDR:MASTER_PORT for a round this node closes.
  virtual std::string round_master(const std::string& my_address) const;
  /// Whether a round after `a` may open.
  virtual bool restart_left(const Assignment& a) const;
  virtual PeerEnded on_peer_ended() const { return PeerEnded::kNewRound; }
  /// Whether the job of this node (in `a`) needs the node that serves the store to go on: then
  /// that node's store going away ends it, unless that node's workers are done.
  virtual bool needs_serving_node(const Assignment& a) const;
  /// The command line that joins the job that the nodes that came are waiting in.
  virtual std::string how_to_join() const = 0;

 protected:
  const RendezvousOptions& o_;  // the rendezvous', which owns this policy
};

/// The policy of `options`' mode: static when fixed_node_rank >= 0, else its backend.
std::unique_ptr<RendezvousPolicy> make_rendezvous_policy(const RendezvousOptions& options);

}  // namespace detail
}  // namespace dist
}  // namespace paratrain
