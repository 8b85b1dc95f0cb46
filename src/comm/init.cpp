#include "paratrain/comm/init.h"

#include "backends.h"
#include "c10d_socket_store.h"
#include "launch/backend_routes.h"
#include "paratrain/store/host_address.h"

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <c10/macros/Macros.h>
#include <torch/cuda.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <set>
#include <sstream>
#include <utility>

namespace paratrain {
namespace dist {

std::chrono::milliseconds default_timeout() {
  const char* text = std::getenv("PARATRAIN_TIMEOUT");
  if (text == nullptr || text[0] == '\0') {
    return kDefaultTimeout;
  }
  char* end = nullptr;
  double seconds = std::strtod(text, &end);
  TORCH_CHECK(end != text && *end == '\0' && std::isfinite(seconds) && seconds > 0,
              "PARATRAIN_TIMEOUT='", text, "' is not a positive number of seconds");
  return std::chrono::milliseconds(static_cast<int64_t>(std::ceil(seconds * 1000)));
}

std::vector<std::string> available_backends() {
  std::vector<std::string> names;
#ifdef PARATRAIN_WITH_GLOO
  names.push_back("gloo");
#endif
#ifdef PARATRAIN_WITH_MPI
  names.push_back("mpi");
#endif
#ifdef PARATRAIN_WITH_NCCL
  names.push_back("nccl");
#endif
  return names;
}

namespace {

bool has_backend(const std::string& name) {
  auto all = available_backends();
  return std::find(all.begin(), all.end(), name) != all.end();
}

bool started_by_mpirun() {
  const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
  return size != nullptr && size[0] != '\0';
}

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) {
    out += (out.empty() ? "" : ", ") + n;
  }
  return out;
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

struct Endpoint {
  std::string host;
  int port = kDefaultMasterPort;
};

Endpoint parse_tcp(const std::string& url) {
  std::string rest = url.substr(std::string("tcp://").size());
  auto colon = rest.rfind(':');
  TORCH_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < rest.size(), "init_method '",
              url, "' must look like tcp://host:port");
  Endpoint e;
  e.host = rest.substr(0, colon);
  if (e.host.size() > 2 && e.host.front() == '[' && e.host.back() == ']') {
    e.host = e.host.substr(1, e.host.size() - 2);
  }
  e.port = parse_int(rest.substr(colon + 1), "port of init_method '" + url + "'");
  TORCH_CHECK(e.port > 0 && e.port < 65536, "port ", e.port, " of init_method '", url,
              "' is not a TCP port");
  return e;
}

// Opens the job's store: rank 0 serves it on the addresses MASTER_ADDR names (loopback only for a
// one-node job), the others connect. Users get one line saying what to check.
c10::intrusive_ptr<c10d::Store> open_tcp_store(const Endpoint& e,
                                               int rank,
                                               std::chrono::milliseconds timeout,
                                               bool server,
                                               bool several_nodes) {
  const std::string where = e.host + ":" + std::to_string(e.port);
  // Served there, ranks on other hosts could not connect and would wait out their timeout. Only
  // a warning: several launchers on one host may rightly meet at a loopback name.
  if (server && several_nodes && is_loopback_name(e.host)) {
    std::cerr << "paratrain: warning: MASTER_ADDR=" << e.host
              << " resolves only to loopback addresses on rank 0's host, where the store is "
                 "served; ranks on other hosts cannot reach it: give an address they reach"
              << std::endl;
  }
  try {
    return c10::make_intrusive<detail::C10dSocketStore>(e.host, e.port, server, timeout);
  } catch (const std::exception& ex) {
    const std::string why = detail::error_message(ex);
    if (server) {
      TORCH_CHECK(why.find("(EADDRINUSE)") == std::string::npos,
                  "rank 0 cannot serve the store on port ", e.port, " of ", e.host,
                  ": address already in use; choose another MASTER_PORT (or launch with "
                  "--standalone, which picks a free port)");
      TORCH_CHECK(why.find("failed to bind") == std::string::npos ||
                      why.find("(EADDRNOTAVAIL)") == std::string::npos,
                  "rank 0 cannot serve the store at ", where, " (", why,
                  "); MASTER_ADDR must be an address of rank 0's own host");
      TORCH_CHECK(false, "rank 0 cannot serve the store at ", where, " (", why,
                  "); check MASTER_ADDR and MASTER_PORT");
    }
    // The store says "cannot connect to HOST:PORT within T ms: REASON"; the line names both.
    const auto reason = why.find(" ms: ");
    TORCH_CHECK(false, "rank ", rank, " could not reach the master at ", where, " within ",
                timeout.count(), " ms (",
                reason == std::string::npos ? why : why.substr(reason + 5),
                "); check MASTER_ADDR/MASTER_PORT and that rank 0 is running");
  }
}

// Every rank counts itself in through the store and waits for the others, so that a missing or
// duplicated rank is reported here, in words, instead of as a Gloo rendezvous timeout.
// `node` is this process's address (toward the master) and `per_node` its LOCAL_WORLD_SIZE: a
// duplicate or a missing rank is then said in nodes, which is what a user starts by hand.
void join(c10d::Store& store,
          int rank,
          int world_size,
          std::chrono::milliseconds timeout,
          const std::string& node,
          int per_node) {
  const std::string rank_key = "paratrain/join/rank/" + std::to_string(rank);
  if (store.add(rank_key, 1) != 1) {
    // The first process of this rank writes its address right after its add: wait for it a
    // little (a loaded machine delays that write; asking at once read nothing, and named "?").
    const std::string from_key = "paratrain/join/from/" + std::to_string(rank);
    std::vector<uint8_t> first;
    try {
      store.wait({from_key}, std::min(timeout, std::chrono::milliseconds(5000)));
      first = store.get(from_key);
    } catch (const std::exception&) {  // it died in between: the address stays unknown
    }
    const char* group_rank = std::getenv("GROUP_RANK");
    TORCH_CHECK(false, "rank ", rank, " joined twice (from ",
                first.empty() ? std::string("?") : std::string(first.begin(), first.end()),
                " and from ", node, "): two processes were started with the same rank",
                group_rank ? std::string("; two nodes claim node rank ") + group_rank +
                                 ": give each node its own --node-rank"
                           : std::string("; check RANK"));
  }
  store.set("paratrain/join/from/" + std::to_string(rank),
            std::vector<uint8_t>(node.begin(), node.end()));
  const int64_t joined = store.add("paratrain/join/count", 1);
  TORCH_CHECK(joined <= world_size, "more than WORLD_SIZE=", world_size,
              " processes joined this job; check that every rank has the same WORLD_SIZE");
  if (joined == world_size) {
    store.set("paratrain/join/all", std::vector<uint8_t>{1});
  }
  try {
    store.wait({"paratrain/join/all"}, timeout);
  } catch (const std::exception&) {
    std::string missing;
    std::set<int> nodes;
    int n_missing = 0;
    for (int r = 0; r < world_size; ++r) {
      if (!store.check({"paratrain/join/rank/" + std::to_string(r)})) {
        missing += (n_missing++ ? ", " : "") + std::to_string(r);
        nodes.insert(r / std::max(1, per_node));
      }
    }
    std::string node_list;
    for (int n : nodes) {
      node_list += (node_list.empty() ? "" : ", ") + std::to_string(n);
    }
    const bool several_nodes = per_node > 0 && per_node < world_size;
    TORCH_CHECK(
        false, "rank ", rank, " waited ", timeout.count(), " ms for all ", world_size,
        " ranks to join, but ", n_missing, " did not: rank", n_missing == 1 ? " " : "s ", missing,
        several_nodes ? " (node rank" + std::string(nodes.size() == 1 ? " " : "s ") + node_list +
                            ", " + std::to_string(per_node) + " ranks per node, never joined)"
                      : std::string(),
        "; check that they were started with the same MASTER_ADDR/MASTER_PORT and "
        "WORLD_SIZE");
  }
}

// A peer that dies mid-collective closes its sockets; Gloo's next write to one raises SIGPIPE,
// whose default action kills this rank silently (exit 141) before the collective can report
// which operation and which ranks failed. Python ignores SIGPIPE at start-up, so PyTorch's
// ranks see EPIPE as an error instead; a C++ program gets the same here. A handler the program
// installed itself is left alone. The processes paratrain starts get the default back (launch,
// tune), as Python's subprocess does. The cost: a rank whose stdout reader has gone (`| head`)
// no longer dies at its next line; under `paratrain launch` it ends with the launcher.
void ignore_broken_pipes() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    ::sigaction(SIGPIPE, &ignore, nullptr);
  }
}

}  // namespace

namespace {

std::string missing_backend_hint(const std::string& name) {
  if (name == "nccl") {
    return "; nccl needs a libtorch built with CUDA";
  }
  if (name == "mpi") {
    return "; mpi needs Open MPI (libopenmpi-dev) at build time";
  }
  return "; gloo needs gloo's headers at build time (libgloo-dev, or -DGLOO_INCLUDE_DIR)";
}

void check_engine(const std::string& name, const std::string& spec) {
  TORCH_CHECK(name == "gloo" || name == "mpi" || name == "nccl", "unknown backend '", name, "'",
              spec == name ? "" : " in '" + spec + "'",
              ": choose auto, gloo, mpi or nccl, or routes such as cpu:gloo,cuda:nccl");
  TORCH_CHECK(has_backend(name), "backend '", name, "' is not in this build (it has ",
              join(available_backends()), ")", missing_backend_hint(name));
}

}  // namespace

#ifdef PARATRAIN_WITH_MPI
namespace {
// Rank and size come from mpirun.
ProcessGroupPtr make_mpi(const InitOptions& options, std::chrono::milliseconds timeout) {
  auto pg = detail::make_mpi_group(timeout);
  TORCH_CHECK(options.world_size() < 0 || options.world_size() == pg->size(), "world_size ",
              options.world_size(), " was asked for, but mpirun started ", pg->size(), " ranks");
  return pg;
}
}  // namespace
#endif

std::vector<std::pair<c10::DeviceType, std::string>> parse_backend_routes(const std::string& spec,
                                                                          bool check_built) {
  auto routes = detail::parse_routes(spec);
  if (check_built) {
    for (const auto& r : routes) {
      check_engine(r.second, spec);
    }
  }
  return routes;
}

std::string resolve_backend(const InitOptions& options) {
  std::string name = options.backend();
  if (name == "auto") {
    const char* env = std::getenv("PARATRAIN_BACKEND");
    if (env != nullptr && env[0] != '\0') {
      name = env;
    }
  }
  if (name == "auto") {
    // As torch.distributed 2.x with no backend named: CPU tensors over gloo (mpi under mpirun),
    // CUDA tensors over nccl, in one group.
    const std::string cpu = started_by_mpirun() && has_backend("mpi") ? "mpi"
                            : has_backend("gloo")                     ? "gloo"
                                                                      : "";
    if (options.uses_cuda() && has_backend("nccl")) {
      return cpu.empty() ? "nccl" : "cpu:" + cpu + ",cuda:nccl";
    }
    TORCH_CHECK(!cpu.empty(), "no backend in this build can move CPU tensors (it has ",
                join(available_backends()), ")", missing_backend_hint("gloo"));
    return cpu;
  }
  if (name.find(':') == std::string::npos) {
    check_engine(name, name);
    return name;
  }
  // Routes: one engine named for both device types is that engine alone.
  const auto routes = parse_backend_routes(name);
  std::string normal;
  bool one_engine = true;
  for (const auto& r : routes) {
    normal += (normal.empty() ? "" : ",") +
              std::string(r.first == c10::DeviceType::CPU ? "cpu" : "cuda") + ":" + r.second;
    one_engine = one_engine && r.second == routes.front().second;
  }
  return one_engine && routes.size() > 1 ? routes.front().second : normal;
}

namespace {

// Where the ranks meet: the job's store, how the store monitor opens a client of it (none for a
// store without a server), and this rank's address toward the others.
struct JobStore {
  c10::intrusive_ptr<c10d::Store> store;
  detail::StoreClientFactory monitor_client;
  std::string hostname;
};

JobStore open_file_store(const std::string& method, int world_size) {
  JobStore js;
  std::string path = method.substr(std::string("file://").size());
  TORCH_CHECK(!path.empty() && path[0] == '/', "init_method '", method,
              "' must name an absolute path, as file:///tmp/paratrain-store");
  try {
    js.store = c10::make_intrusive<c10d::FileStore>(path, world_size);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "cannot open the file store ", path, ": ", detail::error_message(e));
  }
  js.hostname = "127.0.0.1";
  return js;
}

// tcp://host:port, or env:// (MASTER_ADDR and MASTER_PORT).
JobStore open_tcp_job_store(const std::string& method,
                            const RankInfo& info,
                            int rank,
                            int world_size,
                            std::chrono::milliseconds timeout) {
  JobStore js;
  Endpoint e;
  if (method == "env://") {
    if (info.master_addr.empty()) {
      TORCH_CHECK(info.single_node(),
                  "MASTER_ADDR is not set, and this job spans several nodes (WORLD_SIZE=",
                  world_size, ", LOCAL_WORLD_SIZE=", info.local_world_size,
                  "): set MASTER_ADDR to the address of rank 0's node");
      e.host = "127.0.0.1";
    } else {
      e.host = info.master_addr;
    }
    e.port = info.master_port;
  } else {
    e = parse_tcp(method);
  }
  if (world_size == 1 && method == "env://" && info.master_addr.empty()) {
    js.store = c10::make_intrusive<c10d::HashStore>();  // a world of one needs no network
  } else {
    js.store = open_tcp_store(e, rank, timeout, rank == 0,
                              info.source != "default" && !info.single_node());
    js.monitor_client = [e, timeout]() {
      return open_tcp_store(e, -1, std::min(timeout, std::chrono::milliseconds(10000)), false,
                            false);
    };
  }
  js.hostname = is_loopback(e.host) ? "127.0.0.1" : route_source_address(e.host, e.port);
  return js;
}

// What every engine's group is made with.
struct EngineArgs {
  const InitOptions& options;
  int rank;
  int world_size;
  std::chrono::milliseconds timeout;
  const std::string& hostname;
  int device_index;
};

ProcessGroupPtr make_engine_group(const std::string& engine,
                                  c10::intrusive_ptr<c10d::Store> s,
                                  detail::StoreClientFactory client,
                                  const EngineArgs& a) {
  try {
#ifdef PARATRAIN_WITH_GLOO
    if (engine == "gloo") {
      return detail::make_gloo_group(s, client, a.rank, a.world_size, a.timeout, a.hostname);
    }
#endif
#ifdef PARATRAIN_WITH_NCCL
    if (engine == "nccl") {
      return detail::make_nccl_group(s, client, a.rank, a.world_size, a.timeout, a.device_index);
    }
#endif
#ifdef PARATRAIN_WITH_MPI
    if (engine == "mpi") {
      return make_mpi(a.options, a.timeout);
    }
#endif
  } catch (const std::exception& e) {
    TORCH_CHECK(false, engine, " rendezvous failed on rank ", a.rank, " of ", a.world_size, ": ",
                detail::error_message(e));
  }
  TORCH_INTERNAL_ASSERT(false, "backend ", engine, " resolved but not built");
}

// Each engine of a routed group meets under a prefix of its own, so their rendezvous keys and
// heartbeats never mix.
ProcessGroupPtr make_route_groups(const std::string& backend,
                                  const JobStore& js,
                                  const EngineArgs& a) {
  std::vector<detail::Route> routes;
  for (const auto& r : parse_backend_routes(backend)) {
    const std::string prefix = "paratrain/route/" + r.second;
    detail::StoreClientFactory client;
    if (js.monitor_client) {
      client = [f = js.monitor_client, prefix]() -> c10::intrusive_ptr<c10d::Store> {
        return c10::make_intrusive<c10d::PrefixStore>(prefix, f());
      };
    }
    ProcessGroupPtr group = make_engine_group(
        r.second, c10::make_intrusive<c10d::PrefixStore>(prefix, js.store), std::move(client), a);
    routes.push_back({r.first, std::move(group)});
  }
  return detail::make_routed_group(std::move(routes), backend);
}

}  // namespace

ProcessGroupPtr init_process_group(const InitOptions& options) {
  ignore_broken_pipes();
  const std::string backend = resolve_backend(options);
  const auto timeout = options.timeout();
  TORCH_CHECK(timeout.count() > 0, "timeout must be positive, got ", timeout.count(), " ms");

#ifdef PARATRAIN_WITH_MPI
  if (backend == "mpi") {
    return make_mpi(options, timeout);  // MPI brings its own rendezvous (mpirun's runtime)
  }
#endif

  RankInfo info = discover_rank_info();
  int rank = options.rank() >= 0 ? options.rank() : info.rank;
  int world_size = options.world_size() >= 0 ? options.world_size() : info.world_size;
  TORCH_CHECK(world_size >= 1, "world size must be at least 1, got ", world_size);
  TORCH_CHECK(rank >= 0 && rank < world_size, "rank ", rank, " is out of range for world size ",
              world_size, ": it must be in [0, ", world_size - 1, "]");

  const std::string& method = options.init_method();
  JobStore js;
  if (method.rfind("file://", 0) == 0) {
    js = open_file_store(method, world_size);
  } else if (method.rfind("tcp://", 0) == 0 || method == "env://") {
    js = open_tcp_job_store(method, info, rank, world_size, timeout);
  } else {
    TORCH_CHECK(false, "unknown init_method '", method,
                "': use env://, tcp://host:port or file:///path");
  }

  if (world_size > 1) {
    const std::string node_address =
        js.hostname == "127.0.0.1" || js.hostname.empty() ? std::string("127.0.0.1") : js.hostname;
    join(*js.store, rank, world_size, timeout, node_address, info.local_world_size);
  }
  // The CUDA device of this rank for nccl: local_device()'s, cuda:LOCAL_RANK; -1 (none bound)
  // when this node's ranks outnumber its GPUs (local_device() refuses that job; a program that
  // routes only CPU tensors still runs).
  const int device_index =
      info.local_world_size <= static_cast<int>(torch::cuda::device_count()) ? info.local_rank : -1;
  const EngineArgs args{options, rank, world_size, timeout, js.hostname, device_index};
  if (backend.find(':') == std::string::npos) {
    return make_engine_group(backend, js.store, js.monitor_client, args);
  }
  return make_route_groups(backend, js, args);
}

}  // namespace dist
}  // namespace paratrain
