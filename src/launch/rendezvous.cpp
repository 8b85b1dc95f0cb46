#include "rendezvous.h"

#include "paratrain/store/host_address.h"

#include "base/errors.h"

#include <c10/util/Exception.h>

#include <unistd.h>

#include <algorithm>
#include <iomanip>
#include <iostream>
#include <optional>
#include <sstream>
#include <thread>

namespace paratrain {
namespace dist {
namespace detail {
namespace {

using paratrain::detail::error_message;

using Clock = std::chrono::steady_clock;
constexpr std::chrono::milliseconds kPoll{100};
// "15 s", "2.5 s": seconds as a person writes them.
std::string seconds_text(std::chrono::steady_clock::duration d) {
  std::ostringstream out;
  out << std::setprecision(3)
      << std::chrono::duration_cast<std::chrono::milliseconds>(d).count() / 1000.0 << " s";
  return out.str();
}
}  // namespace

Rendezvous::Rendezvous(RendezvousOptions options)
    : o_(std::move(options)), policy_(make_rendezvous_policy(o_)) {
  TORCH_CHECK(!o_.id.empty(), "--rdzv-id is empty: give the job a name every node shares");
  store_ = policy_->open_store(&serving_);
  start();
}

Rendezvous::Rendezvous(RendezvousOptions options, std::unique_ptr<RendezvousStore> store)
    : o_(std::move(options)), policy_(make_rendezvous_policy(o_)), store_(std::move(store)) {
  TORCH_CHECK(!o_.id.empty(), "--rdzv-id is empty: give the job a name every node shares");
  start();
}

// This run's generation of the id, this node's address, and the job's signature.
void Rendezvous::start() {
  generation_ = store_->add(keys().generation_counter(), 0);
  if (policy_->store_outlives_nodes()) {
    skip_dead_generation();
  }
  my_address_ = o_.local_addr.empty() ? route_source_address(o_.host, o_.port) : o_.local_addr;
  if (my_address_.empty()) {
    my_address_ = o_.host;
  }
  const std::string theirs = store_->compare_set(keys().signature(), "", o_.signature);
  TORCH_CHECK(theirs == o_.signature, "rendezvous ", describe(),
              ": the id is in use by another job (", theirs, "; this node: ", o_.signature,
              "); give this job its own --rdzv-id");
}

Rendezvous::~Rendezvous() = default;

int64_t Rendezvous::read_int(const std::string& k) {
  return store_->add(k, 0);
}

std::string Rendezvous::describe() const {
  return "'" + o_.id + "' at " + o_.host + ":" + std::to_string(o_.port);
}

std::string Rendezvous::get_or(const std::string& k, const std::string& fallback) {
  return store_->get(k).value_or(fallback);
}

void Rendezvous::check_shutdown(bool may_move) {
  if (!store_->check(keys().shutdown())) {
    return;
  }
  if (!admitted_ && may_move) {
    // The job of this generation ended before this node took part: a run that starts now with
    // the same id is a new job, in the generation the ending one moved to. Only between rounds
    // (next()'s loop): inside one, the round's keys belong to the old generation.
    const int64_t now = store_->add(keys().generation_counter(), 0);
    if (now != generation_) {
      generation_ = now;
      return;
    }
  }
  // The reason first: once every node has counted itself, the serving node exits with its store.
  const std::string why = get_or(keys().shutdown(), "");
  note_shutdown_seen();
  TORCH_CHECK(false, "rendezvous ", describe(), ": the job ended: ", why);
}

// Counted once per node: the node serving a socket store waits for every other node's count.
void Rendezvous::note_shutdown_seen() {
  if (!shutdown_seen_) {
    shutdown_seen_ = true;
    store_->add(keys().shutdown_seen(), 1);
  }
}

void Rendezvous::shut_down(const std::string& why, int others) {
  try {
    // The first reason stands: later ones are usually its consequences.
    store_->compare_set(keys().shutdown(), "", why);
    if (serving_) {
      // The store dies with this process: wait (boundedly) until the others have read why.
      const auto deadline = Clock::now() + o_.keep_alive + std::chrono::seconds(3);
      while (read_int(keys().shutdown_seen()) < others && Clock::now() < deadline) {
        std::this_thread::sleep_for(kPoll);
      }
    }
    next_generation();  // a later run with this id starts clean
  } catch (const std::exception&) {
    // The store is gone: the other nodes find out from it too.
  }
}

Assignment Rendezvous::next() {
  TORCH_CHECK(broken_.empty(), "rendezvous ", describe(),
              ": the connection to the endpoint failed (", broken_,
              "); the node serving it has probably ended");
  // A store that cannot be reached (a partition, see Note [Partitions and dead nodes]) is tried
  // again for the join timeout from its first failure; one that is gone, or a refusal of the
  // rendezvous, ends here.
  std::optional<Clock::time_point> unreachable_since;
  for (;;) {
    try {
      open_pending_round();
      Assignment a = join();
      joined_.clear();  // a later next() in this round is a node that came back: a new ticket
      last_contact_ = Clock::now();
      return a;
    } catch (const std::exception& e) {
      // A store whose calls never fail for silence (etcd) says no to both.
      if (!store_->last_call_unreachable()) {
        TORCH_CHECK(!store_->last_call_found_none(), "rendezvous ", describe(),
                    ": the node serving it has ended (", error_message(e), ")");
        throw;
      }
      if (!unreachable_since) {
        unreachable_since = Clock::now();
        std::cerr << "paratrain launch: rendezvous " << describe() << ": no answer ("
                  << error_message(e) << "); trying again for up to "
                  << seconds_text(o_.join_timeout) << std::endl;
      }
      TORCH_CHECK(Clock::now() - *unreachable_since < o_.join_timeout, "rendezvous ", describe(),
                  ": the endpoint did not answer for ", seconds_text(o_.join_timeout), " (",
                  error_message(e), "): its host is down or cut off from this one");
      std::this_thread::sleep_for(std::chrono::seconds(1));
    }
  }
}

// This node left round pending_->left while the store did not answer: the others may not have
// noticed (their view of its heartbeat lags), so the next round opens now. A static job with no
// restart left ends instead, when the node left for lost contact (a failure checked that first).
void Rendezvous::open_pending_round() {
  if (!pending_) {
    return;
  }
  const PendingRound p = *pending_;
  if (read_int(keys().round()) == p.left.round) {
    if (p.reason == "unreachable" && !policy_->restart_left(p.left)) {
      pending_.reset();
      const std::string why = "node " + std::to_string(p.left.node_rank) +
                              " lost contact with the others; no restart left (--max-restarts " +
                              std::to_string(o_.max_restarts) + ")";
      shut_down(why, p.left.nnodes - 1);
      note_shutdown_seen();
      TORCH_CHECK(false, "rendezvous ", describe(), ": the job ended: ", why);
    }
    open_next_round(p.left, p.reason);
  }
  pending_.reset();
}

// This launcher, as the store's claims name it.
std::string Rendezvous::me() const {
  return my_address_ + " (pid " + std::to_string(::getpid()) + ")";
}

// One attempt at joining the open round (next()). A retry after the store stopped answering keeps
// the ticket this node already took in that round, and a round closed already is not closed
// again; the closer's writes keep the first value (compareSet), should a retry repeat them.
// This node's ticket in `round` (kept across retries), or 0 when the round is moved past: a
// ticket drawn before whose reply never came may or may not have counted, and a count one off
// would close the round with a place nobody holds (or none with ticket 1 to close it), so the
// round is abandoned for the next one, which every node joins.
int64_t Rendezvous::draw_ticket(int64_t round) {
  if (joined_ == keys().count(round)) {
    return joined_ticket_;
  }
  if (abandoned_ == round) {
    store_->compare_set(keys().round(), std::to_string(round), std::to_string(round + 1));
    abandoned_.reset();
    return 0;
  }
  abandoned_ = round;  // until the reply comes
  joined_ticket_ = store_->add(keys().count(round), 1);
  joined_ = keys().count(round);
  abandoned_.reset();
  return joined_ticket_;
}

// Whether a node abandoned `round` (draw_ticket) while this one waited for it to close.
bool Rendezvous::round_moved(int64_t round) {
  return read_int(keys().round()) > round;
}

Assignment Rendezvous::join() {
  for (;;) {
    check_shutdown(/*may_move=*/true);
    const int64_t round = read_int(keys().round());
    // This node's place, from 1: its fixed node rank + 1 (claimed before it counts), or the order
    // of joining.
    const int64_t fixed = policy_->claim_place(*store_, keys(), round, me());
    if (draw_ticket(round) == 0) {
      continue;  // the round was abandoned: the next one is open
    }
    const int64_t ticket = joined_ticket_;
    const int64_t place = fixed > 0 ? fixed : ticket;
    const bool closed = store_->check(keys().closed(round));
    if (place > o_.max_nodes || (closed && place > std::stoll(get_or(keys().closed(round), "0")))) {
      wait_standby(round);
      continue;
    }
    store_->set(keys().addr(round, place - 1), my_address_);
    if (store_->ephemeral_kept()) {  // from now on: Note [Partitions and dead nodes]
      store_->set_ephemeral(keys().alive(round, place - 1), "1");
    }
    // Ticket 1 closes: node rank 0, whose host serves the workers' store (the round's master).
    if ((!closed && ticket == 1 && !close_round(round)) || !wait_closed(round)) {
      continue;  // the round was abandoned: the next one is open
    }
    const int64_t nnodes = std::stoll(get_or(keys().closed(round), "0"));
    if (place > nnodes) {
      wait_standby(round);
      continue;
    }
    Assignment a;
    a.round = round;
    a.node_rank = static_cast<int>(place - 1);
    a.nnodes = static_cast<int>(nnodes);
    const std::string master = get_or(keys().master(round), "");
    a.master_addr = master.substr(0, master.rfind(':'));
    a.master_port = std::stoi(master.substr(master.rfind(':') + 1));
    node0_done_ = false;
    last_beats_.assign(static_cast<size_t>(nnodes), -1);
    last_moved_.assign(static_cast<size_t>(nnodes), Clock::now());
    ended_since_.assign(static_cast<size_t>(nnodes), Clock::time_point{});
    admitted_ = true;
    return a;
  }
}

// Moves the id to the next generation, once however many nodes ask (each ends the same run).
void Rendezvous::next_generation() {
  store_->compare_set(keys().generation_counter(), std::to_string(generation_),
                      std::to_string(generation_ + 1));
}

// etcd outlives the launchers: a run whose launchers were all killed (no finish, no shutdown)
// would keep later runs with its id waiting for its closed round forever. A closed round whose
// heartbeats stand still for the keep-alive time is such a run: the id moves past it.
void Rendezvous::skip_dead_generation() {
  const int64_t round = read_int(keys().round());
  if (store_->check(keys().shutdown()) || store_->check(keys().finished())) {
    next_generation();  // the run ended; its ender may have died before moving the id on
    generation_ = read_int(keys().generation_counter());
    return;
  }
  const std::optional<std::string> closed = store_->get(keys().closed(round));
  if (!closed && read_int(keys().count(round)) == 0) {
    return;  // a fresh id, or a round nobody joined yet
  }
  // A closed round's nodes beat while their workers run; an open round's first node beats while
  // it waits to close it.
  auto beats = [&] {
    std::vector<int64_t> b{read_int(keys().closer_beat(round))};
    for (int64_t n = 0; closed && n < std::stoll(*closed); ++n) {
      b.push_back(read_int(keys().beat(round, n)));
    }
    return b;
  };
  const std::vector<int64_t> first = beats();
  const auto deadline = Clock::now() + o_.keep_alive + std::chrono::seconds(1);
  while (Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    if (beats() != first || read_int(keys().round()) != round) {
      return;  // alive
    }
  }
  std::cerr << "paratrain launch: rendezvous " << describe() << ": the last run with this id "
            << "stands still in round " << round << " (no heartbeat for "
            << (o_.keep_alive.count() + 1000) / 1000.0 << " s: its launchers are gone); "
            << "starting a new run" << std::endl;
  next_generation();
  generation_ = read_int(keys().generation_counter());
}

// False when the round was moved past before it closed.
bool Rendezvous::wait_closed(int64_t round) {
  const auto deadline = Clock::now() + o_.join_timeout + o_.last_call;
  while (!store_->check(keys().closed(round))) {
    if (store_->check(keys().failed(round))) {
      TORCH_CHECK(false, get_or(keys().failed(round), ""));
    }
    check_shutdown();
    if (round_moved(round)) {
      return false;
    }
    TORCH_CHECK(Clock::now() < deadline, "rendezvous ", describe(), ": round ", round,
                " was never closed: its first node (", get_or(keys().addr(round, 0), "unknown"),
                ") stopped before enough nodes joined");
    std::this_thread::sleep_for(kPoll);
  }
  return true;
}

// False when the round was moved past before it could close.
bool Rendezvous::close_round(int64_t round) {
  const auto start = Clock::now();
  std::optional<Clock::time_point> enough_since;
  Clock::time_point next_closer_beat{};
  int64_t count = 0;
  for (;;) {
    count = read_int(keys().count(round));
    if (count >= o_.max_nodes) {
      break;
    }
    if (count >= o_.min_nodes) {
      enough_since = enough_since.value_or(Clock::now());
      if (Clock::now() - *enough_since >= o_.last_call) {
        break;
      }
    } else if (Clock::now() - start >= o_.join_timeout) {
      const std::string message = "rendezvous " + describe() + ": " + std::to_string(count) +
                                  " of the " + std::to_string(o_.min_nodes) +
                                  " nodes needed (--nnodes " + std::to_string(o_.min_nodes) + ":" +
                                  std::to_string(o_.max_nodes) + ") joined within " +
                                  std::to_string(o_.join_timeout.count() / 1000.0) +
                                  " s; the others never joined: " + policy_->how_to_join();
      store_->set(keys().failed(round), message);
      shut_down(message, static_cast<int>(count) - 1);
      TORCH_CHECK(false, message);
    }
    check_shutdown();
    if (round_moved(round)) {
      return false;
    }
    if (policy_->store_outlives_nodes() && Clock::now() >= next_closer_beat) {
      store_->add(keys().closer_beat(round), 1);  // alive, for skip_dead_generation
      next_closer_beat = Clock::now() + std::chrono::milliseconds(500);
    }
    std::this_thread::sleep_for(kPoll);
  }
  const int64_t nnodes = std::min<int64_t>(count, o_.max_nodes);
  // The first value stands: a retry (the store did not answer) must not change what others read.
  store_->compare_set(keys().master(round), "", policy_->round_master(my_address_));
  store_->compare_set(keys().closed(round), "", std::to_string(nnodes));
  return true;
}

void Rendezvous::wait_standby(int64_t round) {
  const auto deadline = Clock::now() + o_.join_timeout;
  // The store's own failures become one line; this file's messages pass as they are.
  auto ask = [&](const std::function<bool()>& call) {
    try {
      return call();
    } catch (const std::exception& e) {
      const std::string what = error_message(e);
      TORCH_CHECK(what.rfind("rendezvous ", 0) != 0, what);
      TORCH_CHECK(false, "rendezvous ", describe(), ": this node waited to join round ", round + 1,
                  " and the rendezvous went away (", what, "): the job ended without taking it in");
    }
  };
  ask([&] { return store_->add(keys().waiting(round), 1) > 0; });
  while (ask([&] { return read_int(keys().round()) <= round; })) {
    TORCH_CHECK(!ask([&] { return store_->check(keys().finished()); }), "rendezvous ", describe(),
                ": the job finished before it could take this node in");
    ask([&] {
      check_shutdown();
      return true;
    });
    TORCH_CHECK(Clock::now() < deadline, "rendezvous ", describe(), ": round ", round,
                " runs without this node, and no new round opened within ",
                o_.join_timeout.count() / 1000.0, " s (the job is at --nnodes max, ", o_.max_nodes,
                ", or stalled)");
    std::this_thread::sleep_for(kPoll);
  }
}

void Rendezvous::open_next_round(const Assignment& a, const std::string& reason) {
  try {
    // The first opener's reason stands (compareSet on an absent key).
    store_->compare_set(keys().next_reason(a.round), "", reason);
    store_->compare_set(keys().round(), std::to_string(a.round), std::to_string(a.round + 1));
  } catch (const std::exception&) {
    if (store_->last_call_unreachable()) {
      // next() opens it once the store answers; meanwhile this node leaves the round too.
      pending_ = PendingRound{a, reason,
                              "the rendezvous did not answer while this node opened round " +
                                  std::to_string(a.round + 1)};
    }
    throw;
  }
}

bool Rendezvous::must_restart(const Assignment& a, std::string* why, bool* membership) {
  bool ignored = false;
  bool& dead_peer = membership != nullptr ? *membership : ignored;
  dead_peer = false;  // only a change of members (a dead peer, a standby) explains a failure
  if (pending_) {
    *why = pending_->why;  // this node decided to leave the round: its workers stop
    return true;
  }
  if (!broken_.empty()) {
    return false;  // no more calls on a connection that failed: a late reply could be misread
  }
  if (Clock::now() < retry_after_) {
    return false;  // etcd failed a moment ago: the supervisor's loop must not wait on it each time
  }
  try {
    store_->add(keys().beat(a.round, a.node_rank), 1);
    last_contact_ = Clock::now();
    if (store_->ephemeral_kept()) {
      // Kept as long as this launcher's connection: the others tell its end from a partition.
      store_->set_ephemeral(keys().alive(a.round, a.node_rank), "1");
    }
    if (store_->check(keys().shutdown())) {
      // The reason before the count: the serving node exits once every node has counted itself.
      *why = "a node gave up: " + get_or(keys().shutdown(), "");
      note_shutdown_seen();
      return true;
    }
    if (read_int(keys().round()) > a.round) {
      const std::string reason = get_or(keys().next_reason(a.round), "");
      // A round opened to take in a standby is a change of members too: the node that opened it
      // stopped its workers, which fails the collectives of this node's.
      dead_peer = reason == "dead" || reason == "unreachable" || reason == "grow";
      *why = "another node opened rendezvous round " + std::to_string(a.round + 1) +
             (reason == "dead"          ? " without a node that stopped"
              : reason == "unreachable" ? " after losing contact with a node"
              : reason == "grow"        ? " to take in waiting nodes"
                                        : " after a failure");
      return true;
    }
    if (policy_->needs_serving_node(a) && !node0_done_) {
      // Node 0 serves the store until every node is done, or for a while: once its workers are
      // done, its store going away is no failure.
      node0_done_ = store_->check(keys().done(a.round, 0));
    }
    const int64_t waiting = read_int(keys().waiting(a.round));
    if (waiting > 0 && a.nnodes < o_.max_nodes) {
      *why = std::to_string(waiting) + " node" + (waiting == 1 ? "" : "s") +
             " waiting to join; the job can grow to " + std::to_string(o_.max_nodes);
      open_next_round(a, "grow");
      dead_peer = true;  // another node may have stopped its workers for the same standby
      return true;
    }
    return peer_stopped(a, why, dead_peer);
  } catch (const std::exception& e) {
    return store_failed(a, e, why);
  }
}

// A peer whose heartbeat stood still for the keep-alive time (and is not done): ended, or
// unreachable (Note [Partitions and dead nodes]).
bool Rendezvous::peer_stopped(const Assignment& a, std::string* why, bool& dead_peer) {
  for (int n = 0; n < a.nnodes; ++n) {
    if (n == a.node_rank) {
      continue;
    }
    const auto i = static_cast<size_t>(n);
    const int64_t beat = read_int(keys().beat(a.round, n));
    if (beat != last_beats_[i]) {
      last_beats_[i] = beat;
      last_moved_[i] = Clock::now();
      ended_since_[i] = Clock::time_point{};
      continue;
    }
    if (Clock::now() - last_moved_[i] <= o_.keep_alive || store_->check(keys().done(a.round, n))) {
      continue;
    }
    const std::string who =
        "node " + std::to_string(n) + " (" + get_or(keys().addr(a.round, n), "?") + ")";
    if (!peer_ended(a, n)) {
      if (ended_since_[i] != Clock::time_point{}) {
        continue;  // its connection closed a moment ago: ended, unless it comes back at once
      }
      dead_peer = true;
      return peer_unreachable(a, who, why);
    }
    *why = who + " stopped its heartbeat " + seconds_text(Clock::now() - last_moved_[i]) + " ago";
    if (policy_->on_peer_ended() == RendezvousPolicy::PeerEnded::kEndJob) {
      // A static job cannot go on without a node: it ends now rather than wait for it.
      *why += "; a static job cannot go on without it";
      shut_down(*why, a.nnodes - 2);
      shutdown_seen_ = true;
      return true;
    }
    dead_peer = true;
    open_next_round(a, "dead");
    return true;
  }
  return false;
}

// Whether stalled node n's launcher has ended: its "alive" key went with its connection, and
// stayed away for a moment. A partition that heals can close an old connection of the node
// (its close arrives late) just before the node sets the key again on a new one, hence the
// moment. Without ephemeral keys (etcd), every stalled node counts as ended.
bool Rendezvous::peer_ended(const Assignment& a, int n) {
  const auto i = static_cast<size_t>(n);
  if (!store_->ephemeral_kept()) {
    return true;
  }
  if (store_->check(keys().alive(a.round, n))) {
    ended_since_[i] = Clock::time_point{};
    return false;
  }
  if (ended_since_[i] == Clock::time_point{}) {
    ended_since_[i] = Clock::now();
  }
  return Clock::now() - ended_since_[i] >= kEndedGrace;
}

// A stalled peer whose launcher's connection is still open: a partition, or a host that stopped.
// A new round waits for it (the join timeout); a static job counts it as a restart.
bool Rendezvous::peer_unreachable(const Assignment& a, const std::string& who, std::string* why) {
  *why = who + " has not been heard from for " + seconds_text(o_.keep_alive) +
         ", and its connection is still open (a network partition, or its host stopped)";
  if (!policy_->restart_left(a)) {
    *why += "; no restart left (--max-restarts " + std::to_string(o_.max_restarts) + ")";
    shut_down(*why, a.nnodes - 2);
    shutdown_seen_ = true;
    return true;
  }
  open_next_round(a, "unreachable");
  return true;
}

// A store call of must_restart failed (Note [Partitions and dead nodes]). etcd's HTTP calls are
// independent, and retried a little later. The socket store: a server that is gone (its node
// ended) is not called again, and next() reports it; one that does not answer is ridden out for
// the keep-alive time, then this node stops its workers to rejoin once it answers.
bool Rendezvous::store_failed(const Assignment& a, const std::exception& e, std::string* why) {
  if (policy_->on_store_failure() == RendezvousPolicy::StoreFailure::kRetryLater) {
    // Nobody's heartbeat was seen while etcd failed: the waits start again from now, so that an
    // outage does not pass for dead nodes.
    retry_after_ = Clock::now() + o_.keep_alive / 4;
    std::fill(last_moved_.begin(), last_moved_.end(), Clock::now() + o_.keep_alive / 4);
    return false;
  }
  if (pending_) {
    *why = pending_->why;  // a new round this node could not open: it leaves this one
    return true;
  }
  if (store_->last_call_unreachable()) {
    const auto silent = Clock::now() - last_contact_;
    if (silent <= o_.keep_alive) {
      return false;
    }
    *why = "the rendezvous at " + o_.host + ":" + std::to_string(o_.port) +
           " has not answered for " + seconds_text(silent) + " (" + error_message(e) + ")";
    pending_ = PendingRound{a, "unreachable", *why};
    return true;
  }
  broken_ = error_message(e);
  if (policy_->needs_serving_node(a) && !node0_done_) {
    // Node 0's launcher serves the store: without it a static job cannot go on.
    *why = "node 0's launcher (" + o_.host + ":" + std::to_string(o_.port) + ") is gone (" +
           broken_ + "); a static job cannot go on without it";
    shutdown_seen_ = true;
    return true;
  }
  return false;
}

bool Rendezvous::membership_changed(const Assignment& a,
                                    std::chrono::milliseconds wait,
                                    std::string* why) {
  const auto deadline = Clock::now() + wait;
  while (Clock::now() < deadline) {
    bool membership = false;
    if (must_restart(a, why, &membership)) {
      // A round another node opened for its own failure does not excuse this node's.
      return membership;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  return false;
}

void Rendezvous::finish(const Assignment& a, std::chrono::milliseconds linger) {
  try {
    store_->set(keys().done(a.round, a.node_rank), "1");
    const int64_t done = store_->add(keys().done(a.round), 1);
    if (done == a.nnodes) {
      store_->set(keys().finished(), "1");  // standbys of this generation learn it
      next_generation();                    // a later run with this id starts clean
    }
    if (!serving_ || done >= a.nnodes) {
      return;
    }
    const auto deadline = Clock::now() + linger;
    while (read_int(keys().done(a.round)) < a.nnodes && Clock::now() < deadline) {
      std::this_thread::sleep_for(kPoll);
    }
  } catch (const std::exception&) {
  }
}

}  // namespace detail
}  // namespace dist
}  // namespace paratrain
