// The elastic launcher (--rdzv-endpoint host:port): torchrun's elastic agent on top of the dynamic
// rendezvous of rendezvous.h. Each round gives this node its place; its workers then run until they
// end, fail, or a new round opens.

#include "paratrain/launch/launch.h"

#include "launch_internal.h"
#include "rendezvous.h"
#include "supervisor.h"

#include <c10/util/Exception.h>

#include <chrono>
#include <exception>
#include <iostream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace paratrain {
namespace dist {
namespace launch_internal {
namespace {

std::pair<std::string, int> parse_endpoint(const std::string& endpoint) {
  const size_t colon = endpoint.rfind(':');
  TORCH_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < endpoint.size() &&
                  endpoint.find_first_not_of("0123456789", colon + 1) == std::string::npos &&
                  endpoint.size() - colon <= 6,
              "--rdzv-endpoint '", endpoint, "' is not host:port");
  const int port = std::stoi(endpoint.substr(colon + 1));
  TORCH_CHECK(port > 0 && port < 65536, "--rdzv-endpoint '", endpoint, "': port ", port,
              " is not a TCP port");
  return {endpoint.substr(0, colon), port};
}

// The rendezvous of `options`: its endpoint, id, node counts and timeouts, and the signature every
// node of the job must share.
detail::RendezvousOptions rendezvous_options(const LaunchOptions& options) {
  detail::RendezvousOptions ro;
  if (agrees_on_restarts(options)) {
    // Node 0's launcher serves the store beside the workers' (master_port, served by rank 0).
    TORCH_CHECK(options.master_port() < 65535, "--master-port ", options.master_port(),
                ": with --max-restarts on several nodes the launchers also use the port after it; "
                "give one below 65535");
    ro.host = options.master_addr();
    ro.port = options.master_port() + 1;
    ro.fixed_node_rank = options.node_rank();
    ro.fixed_master = options.master_addr() + ":" + std::to_string(options.master_port());
    ro.max_restarts = options.max_restarts();
  } else {
    std::tie(ro.host, ro.port) = parse_endpoint(options.rdzv_endpoint());
    ro.backend = options.rdzv_backend();
  }
  ro.id = options.rdzv_id();
  ro.local_addr = options.local_addr();
  ro.max_nodes = options.nnodes();
  ro.min_nodes = options.min_nodes() > 0 ? options.min_nodes() : options.nnodes();
  ro.join_timeout = options.rdzv_join_timeout();
  ro.last_call = options.rdzv_last_call();
  ro.keep_alive = options.rdzv_keep_alive();
  std::string command;
  for (const auto& a : options.command()) {
    command += (command.empty() ? "" : " ") + a;
  }
  ro.signature = "--nnodes " + std::to_string(ro.min_nodes) + ":" + std::to_string(ro.max_nodes) +
                 " --nproc-per-node " + std::to_string(resolved_nproc(options)) + " -- " + command;
  return ro;
}

// The failures of an elastic job so far, and how many of them used a restart (max_restarts).
struct ElasticRestarts {
  std::vector<WorkerFailure> failures;
  int used = 0;
};

// Runs this node's workers for the round `a` gave it (the `attempt`-th round it takes part in),
// until they end or the rendezvous stops them for a new round.
LaunchResult run_round(const LaunchOptions& options,
                       const detail::RendezvousOptions& ro,
                       detail::Rendezvous& rdzv,
                       const detail::Assignment& a,
                       int attempt) {
  const int nproc = resolved_nproc(options);
  std::cerr << options.name() << ": rendezvous " << ro.id << " round " << a.round << ": node "
            << a.node_rank << " of " << a.nnodes << ", world size " << a.nnodes * nproc
            << ", master " << a.master_addr << ":" << a.master_port << std::endl;
  LaunchOptions o = options;
  Environment env = o.env();
  // Static: every node takes part in every round, so the round is the attempt all of them share.
  const int restart_count = ro.fixed_node_rank >= 0 ? static_cast<int>(a.round) : attempt;
  env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(restart_count);
  env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(options.max_restarts());
  env["TORCHELASTIC_RUN_ID"] = ro.id;
  if (ro.min_nodes < ro.max_nodes) {
    env["PARATRAIN_ELASTIC"] = "1";  // the world may change: programs resume across sizes
  }
  o.rdzv_endpoint("")
      .min_nodes(0)
      .nnodes(a.nnodes)
      .node_rank(a.node_rank)
      .master_addr(a.master_addr)
      .master_port(a.master_port)
      .env(env);
  Placement where;
  where.attempt = restart_count;
  LaunchResult r =
      run_job(o, where, [&rdzv, &a](std::string* why) { return rdzv.must_restart(a, why); });
  r.rounds = attempt + 1;
  return r;
}

// After a round: true when this node joins the next one (a new round opened, the membership
// changed, or a restart is left after a failure); false when `r` is the job's result.
bool join_next_round(const LaunchOptions& options,
                     const detail::RendezvousOptions& ro,
                     detail::Rendezvous& rdzv,
                     const detail::Assignment& a,
                     LaunchResult& r,
                     ElasticRestarts& restarts) {
  if (!r.stopped_for.empty() && r.interrupted_by == 0 && r.signal_received == 0) {
    std::cerr << options.name() << ": " << r.stopped_for << "; stopped this node's workers"
              << (rdzv.job_ended() ? "" : " to join the next round") << std::endl;
    return true;  // next() says why the job ended, if it did
  }
  if (r.exit_code == 0 && r.stopped_for.empty()) {
    rdzv.finish(a, std::chrono::seconds(30));
    return false;
  }
  std::string why;
  const bool fixed = ro.fixed_node_rank >= 0;
  // Static: the nodes are fixed, so a failure is a restart whoever caused it; the rounds count
  // them for every node alike.
  if (fixed) {
    restarts.used = static_cast<int>(a.round);
  }
  if (!fixed && r.first_failure && r.interrupted_by == 0 && r.signal_received == 0 &&
      rdzv.membership_changed(a, ro.keep_alive + detail::kEndedGrace + std::chrono::seconds(1),
                              &why)) {
    std::cerr << options.name() << ": " << describe_failure(*r.first_failure) << ", as " << why
              << "; joining the next round (a change of membership, not a restart)" << std::endl;
    return true;
  }
  if (r.first_failure) {
    restarts.failures.push_back(*r.first_failure);
  }
  const bool retry = r.interrupted_by == 0 && r.signal_received == 0 && r.first_failure &&
                     restarts.used < options.max_restarts();
  if (!retry) {
    // The other nodes stop now with this reason, instead of waiting for a round that cannot
    // form (or re-forming without a node that did not die).
    rdzv.shut_down(
        r.summary.empty() ? "node " + std::to_string(a.node_rank) + " stopped" : r.summary,
        a.nnodes - 1);
    r.failures = restarts.failures;
    r.restarts = restarts.used;
    return false;
  }
  try {
    rdzv.open_next_round(a, "failure");  // the others stop at once
  } catch (const std::exception&) {
    // The store's node is gone: the others learn from their own failures.
  }
  ++restarts.used;
  std::cerr << options.name() << ": " << describe_failure(*r.first_failure)
            << "; stopped this node's workers, joining the next round (restart " << restarts.used
            << " of " << options.max_restarts() << ")" << std::endl;
  return true;
}

}  // namespace

bool agrees_on_restarts(const LaunchOptions& options) {
  return options.rdzv_endpoint().empty() && options.max_restarts() > 0 && options.nnodes() > 1 &&
         !launch_internal::runs_on_mpi(options.backend()) && !options.master_addr().empty();
}

// torchrun's elastic agent: rendezvous, run this node's workers, and form a new round when a
// worker fails (counted against max_restarts), when a node stops its heartbeat, or when nodes wait
// to join (neither counted). See rendezvous.h.
LaunchResult launch_elastic(const LaunchOptions& options) {
  validate(options);
  const detail::RendezvousOptions ro = rendezvous_options(options);
  detail::Rendezvous rdzv(ro);
  std::cerr << options.name() << ": rendezvous '" << ro.id << "' at " << ro.host << ":" << ro.port
            << (ro.fixed_node_rank >= 0 ? " (the nodes' restarts)"
                : ro.backend == "etcd"  ? " (etcd)"
                                        : "")
            << ": joining" << std::endl;
  ElasticRestarts restarts;
  LaunchOptions logged = options;
  logged.log_dir(make_log_run_dir(options));
  for (int attempt = 0;; ++attempt) {
    const detail::Assignment a = rdzv.next();
    LaunchResult r = run_round(logged, ro, rdzv, a, attempt);
    if (!join_next_round(options, ro, rdzv, a, r, restarts)) {
      return r;
    }
  }
}

}  // namespace launch_internal
}  // namespace dist
}  // namespace paratrain
