#pragma once

// Internal to launch/: every key the rendezvous keeps in its store, named in one place. A job's
// keys live under its id ("paratrain/rdzv/<id>/"): the generation counter there, a run of the job
// under its generation ("g<N>/"), and a round of that run under the round ("round<R>/").

#include <cstdint>
#include <string>

namespace paratrain {
namespace dist {
namespace detail {

struct RendezvousKeys {
  std::string id;
  int64_t generation = 0;

  // The job's: which run of it is the current one (a job that ended leaves its id to the next).
  std::string generation_counter() const { return under_id("generation"); }

  // The run's (this generation's).
  /// Which job holds the id: a second job given the same id is refused.
  std::string signature() const { return under_run("signature"); }
  /// Why a node gave up, set once; every node then stops.
  std::string shutdown() const { return under_run("shutdown"); }
  /// How many nodes saw the shutdown.
  std::string shutdown_seen() const { return under_run("shutdown_seen"); }
  /// The current round's number.
  std::string round() const { return under_run("round"); }
  /// Set once every node of the last round is done: standbys of this generation learn it.
  std::string finished() const { return under_run("finished"); }

  // A round's.
  /// Tickets of the nodes that joined it.
  std::string count(int64_t round) const { return under_round(round, "count"); }
  /// The number of nodes, set when it closes.
  std::string closed(int64_t round) const { return under_round(round, "closed"); }
  /// Why it failed (a node that could not take part), as the error every node raises.
  std::string failed(int64_t round) const { return under_round(round, "failed"); }
  /// The master's address and port.
  std::string master(int64_t round) const { return under_round(round, "master"); }
  /// The closing node's heartbeat, while it waits for the round to fill.
  std::string closer_beat(int64_t round) const { return under_round(round, "closer_beat"); }
  /// Nodes waiting for the next round (standbys).
  std::string waiting(int64_t round) const { return under_round(round, "waiting"); }
  /// Why the next round was opened.
  std::string next_reason(int64_t round) const { return under_round(round, "next_reason"); }
  /// How many nodes finished.
  std::string done(int64_t round) const { return under_round(round, "done"); }
  /// Node `place`'s address (by joining order), its liveness (ephemeral), its heartbeat, whether
  /// it finished, and a static job's claim of a fixed node rank.
  std::string addr(int64_t round, int64_t place) const { return numbered(round, "addr", place); }
  std::string alive(int64_t round, int64_t place) const { return numbered(round, "alive", place); }
  std::string beat(int64_t round, int64_t node) const { return numbered(round, "beat", node); }
  std::string done(int64_t round, int64_t node) const { return numbered(round, "done", node); }
  std::string claim(int64_t round, int64_t node) const { return numbered(round, "claim", node); }

 private:
  std::string under_id(const std::string& name) const {
    return "paratrain/rdzv/" + id + "/" + name;
  }
  std::string under_run(const std::string& name) const {
    return under_id("g" + std::to_string(generation) + "/" + name);
  }
  std::string under_round(int64_t round, const std::string& name) const {
    return under_run("round" + std::to_string(round) + "/" + name);
  }
  std::string numbered(int64_t round, const std::string& name, int64_t n) const {
    return under_round(round, name + std::to_string(n));
  }
};

}  // namespace detail
}  // namespace dist
}  // namespace paratrain
