// Bad input: one clear line and a non-zero exit, never a hang or a crash. Each case runs a real
// process with the bad setting and checks the line it prints.

#include "test_util.h"

#include "paratrain/comm/init.h"

#include <torch/torch.h>

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <thread>

namespace paratrain {
namespace testing {
namespace {

// A worker started by hand (no launcher) with the given contract variables.
ProcessResult run_worker(const std::map<std::string, std::string>& env,
                         const std::string& mode = "init",
                         double timeout = 60) {
  std::map<std::string, std::string> all{
      {"OMPI_COMM_WORLD_SIZE", "<unset>"}, {"PARATRAIN_BACKEND", "<unset>"},
      {"MASTER_ADDR", "<unset>"},          {"MASTER_PORT", "<unset>"},
      {"LOCAL_WORLD_SIZE", "<unset>"},     {"LOCAL_RANK", "<unset>"}};
  for (const auto& kv : env) {
    all[kv.first] = kv.second;
  }
  return run_process({worker_path(), mode}, all, timeout);
}

int count_lines(const std::string& s) {
  int n = 0;
  for (char c : s) {
    n += c == '\n';
  }
  return n;
}

TEST(BadInput, WorldSizeZero) {
  auto r = run_worker({{"RANK", "0"}, {"WORLD_SIZE", "0"}});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("error: WORLD_SIZE=0 is not a valid world size: it must be at least 1"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(count_lines(r.output), 1) << r.output;
}

TEST(BadInput, RankNotBelowWorldSize) {
  auto r = run_worker({{"RANK", "2"}, {"WORLD_SIZE", "2"}});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("error: RANK=2 is out of range for WORLD_SIZE=2: it must be in [0, 1]"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(count_lines(r.output), 1) << r.output;
}

TEST(BadInput, MissingMasterAddrForMultiNode) {
  auto r = run_worker(
      {{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("error: MASTER_ADDR is not set, and this job spans several nodes"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(count_lines(r.output), 1) << r.output;
}

TEST(BadInput, UnreachableMaster) {
  // Nobody serves this port: rank 1 gives up after the timeout with one line naming the master.
  int port = free_port();
  auto start = std::chrono::steady_clock::now();
  auto r = run_worker({{"RANK", "1"},
                       {"WORLD_SIZE", "2"},
                       {"MASTER_ADDR", "127.0.0.1"},
                       {"MASTER_PORT", std::to_string(port)},
                       {"PARATRAIN_TIMEOUT", "3"}});
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("error: rank 1 could not reach the master at 127.0.0.1:" +
                          std::to_string(port) + " within 3000 ms"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("check MASTER_ADDR/MASTER_PORT"), std::string::npos) << r.output;
  EXPECT_EQ(count_lines(r.output), 1) << r.output;
  EXPECT_LT(seconds, 30);
}

TEST(BadInput, PortAlreadyInUse) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(fd, 1), 0);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  int port = ntohs(addr.sin_port);
  auto r = run_worker({{"RANK", "0"},
                       {"WORLD_SIZE", "2"},
                       {"MASTER_ADDR", "127.0.0.1"},
                       {"MASTER_PORT", std::to_string(port)},
                       {"PARATRAIN_TIMEOUT", "5"}});
  ::close(fd);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("error: rank 0 cannot serve the store on port " + std::to_string(port) +
                          " of 127.0.0.1: address already in use"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(count_lines(r.output), 1) << r.output;
}

// Rank 0 serves the store only where MASTER_ADDR says, so that must be its own host's address.
TEST(BadInput, MasterAddrThatIsNotRankZerosHost) {
  auto r = run_worker({{"RANK", "0"},
                       {"WORLD_SIZE", "2"},
                       {"MASTER_ADDR", "203.0.113.9"},  // TEST-NET-3: no host has it
                       {"MASTER_PORT", std::to_string(free_port())},
                       {"PARATRAIN_TIMEOUT", "5"}});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("error: rank 0 cannot serve the store at 203.0.113.9:"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("MASTER_ADDR must be an address of rank 0's own host"), std::string::npos)
      << r.output;
  EXPECT_EQ(count_lines(r.output), 1) << r.output;
}

// A job over several nodes whose MASTER_ADDR is a name for loopback on rank 0's host (Debian's
// 127.0.1.1 for its own host name): rank 0 warns that other hosts cannot reach its store.
TEST(BadInput, LoopbackMasterNameForSeveralNodesIsWarned) {
  auto r = run_worker({{"RANK", "0"},
                       {"WORLD_SIZE", "4"},
                       {"LOCAL_WORLD_SIZE", "2"},
                       {"LOCAL_RANK", "0"},
                       {"MASTER_ADDR", "localhost"},
                       {"MASTER_PORT", std::to_string(free_port())},
                       {"PARATRAIN_TIMEOUT", "2"}});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("paratrain: warning: MASTER_ADDR=localhost resolves only to loopback "
                          "addresses on rank 0's host"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("did not: ranks 1, 2, 3"), std::string::npos) << r.output;
}

TEST(BadInput, RankThatNeverJoins) {
  // Rank 0 of 2 alone: after the timeout it names the missing rank.
  int port = free_port();
  auto r = run_worker({{"RANK", "0"},
                       {"WORLD_SIZE", "2"},
                       {"MASTER_ADDR", "127.0.0.1"},
                       {"MASTER_PORT", std::to_string(port)},
                       {"PARATRAIN_TIMEOUT", "3"}});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("error: rank 0 waited 3000 ms for all 2 ranks to join, but 1 did not: "
                          "rank 1; check that they were started with the same"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(count_lines(r.output), 1) << r.output;
}

TEST(BadInput, DuplicateRank) {
  // Ranks 0, 1 and another 1 for a world of 2: the second rank 1 is refused by name.
  int port = free_port();
  std::map<std::string, std::string> env{{"WORLD_SIZE", "2"},
                                         {"MASTER_ADDR", "127.0.0.1"},
                                         {"MASTER_PORT", std::to_string(port)},
                                         {"PARATRAIN_TIMEOUT", "10"},
                                         {"OMPI_COMM_WORLD_SIZE", "<unset>"},
                                         {"PARATRAIN_BACKEND", "<unset>"}};
  auto with_rank = [&](const char* rank) {
    auto e = env;
    e["RANK"] = rank;
    return e;
  };
  // The first two form the job and stay in it (rank 1 sleeps 6 s before its allreduce).
  RunningProcess r0 = start_process({worker_path(), "late", "1", "6"}, with_rank("0"));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  RunningProcess r1 = start_process({worker_path(), "late", "1", "6"}, with_rank("1"));
  std::this_thread::sleep_for(std::chrono::milliseconds(2000));
  RunningProcess r2 = start_process({worker_path(), "init"}, with_rank("1"));
  ProcessResult a = r0.finish(60);
  ProcessResult b = r1.finish(60);
  ProcessResult c = r2.finish(60);
  const std::string all = a.output + b.output + c.output;
  EXPECT_NE(all.find("error: rank 1 joined twice (from 127.0.0.1 and from 127.0.0.1): two "
                     "processes were started with the same rank; check RANK"),
            std::string::npos)
      << all;
  EXPECT_EQ(c.exit_code, 1) << all;
  EXPECT_EQ(a.exit_code, 0) << all;  // the real job is unharmed
  EXPECT_EQ(b.exit_code, 0) << all;
}

TEST(BadInput, UnknownBackend) {
  auto r = run_worker({{"PARATRAIN_BACKEND", "carrier-pigeon"}});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(
      r.output.find("error: unknown backend 'carrier-pigeon': choose auto, gloo, mpi or nccl"),
      std::string::npos)
      << r.output;
}

TEST(BadInput, NcclWithoutCuda) {
#ifdef PARATRAIN_WITH_NCCL
  GTEST_SKIP() << "this build has nccl (gpu/gpu_test.cpp checks nccl given CPU tensors)";
#endif
  auto r = run_worker({{"PARATRAIN_BACKEND", "nccl"}});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("backend 'nccl' is not in this build"), std::string::npos) << r.output;
}

TEST(BadInput, PeerDiesMidCollective) {
  // Rank 1 leaves after a barrier (exit 0, so the launcher does not stop the job); rank 0's
  // allreduce, the group's second collective, fails and its error names the operation, itself
  // and rank 1.
  auto r = run_process({cli_path(), "launch", "--standalone", "--nproc-per-node", "2", "--",
                        worker_path(), "die", "1"},
                       {{"PARATRAIN_TIMEOUT", "20"}}, 120);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("[rank 0]: error: allreduce #1 (sum, 262144 bytes) on rank 0 of 2 "
                          "(gloo) failed: "),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("ranks that did not arrive: rank 1 ("), std::string::npos) << r.output;
}

TEST(BadInput, CollectiveTimeoutNamesTheLateRank) {
  // Rank 2 of 3 sleeps past the 5 s timeout (after joining: the rendezvous shares the timeout, and
  // three libtorch processes on a busy 2-core machine can take a few seconds to start); ranks 0
  // and 1 report a timeout naming rank 2.
  auto start = std::chrono::steady_clock::now();
  auto r = run_process({cli_path(), "launch", "--standalone", "--nproc-per-node", "3", "--",
                        worker_path(), "late", "2", "60"},
                       {{"PARATRAIN_TIMEOUT", "5"}}, 120);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("error: allreduce #0 (sum, 262144 bytes) on rank "), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("failed: timed out after 5000 ms"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("ranks that did not arrive: rank 2 (has not issued this collective; it "
                          "has issued 0 so far)"),
            std::string::npos)
      << r.output;
  EXPECT_LT(seconds, 40) << "the job was not torn down soon after the timeout";
}

// Gloo's reduce_scatter and allgather are sends and receives between every pair of ranks: a late
// rank still makes a timeout that names the operation and the rank.
TEST(BadInput, ExchangeTimeoutNamesTheLateRank) {  // ctest: slow 20
  for (const std::string op : {"reduce_scatter", "allgather"}) {
    auto r = run_process({cli_path(), "launch", "--standalone", "--nproc-per-node", "3", "--",
                          worker_path(), "late", "2", "60", op},
                         {{"PARATRAIN_TIMEOUT", "5"}}, 120);
    ASSERT_FALSE(r.timed_out) << r.output;
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("error: " + op + " #0 ("), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("rank 2) on rank "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("failed: timed out after 5000 ms"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("ranks that did not arrive: rank 2 (has not issued this collective; "
                            "it has issued 0 so far)"),
              std::string::npos)
        << r.output;
  }
}

TEST(BadInput, MpiCollectiveTimeout) {
#ifndef PARATRAIN_WITH_MPI
  GTEST_SKIP() << "this build has no mpi backend";
#endif
  auto r = run_process({cli_path(), "launch", "--backend", "mpi", "--nproc-per-node", "2", "--",
                        worker_path(), "late", "1", "60"},
                       {{"PARATRAIN_TIMEOUT", "3"}}, 120);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[rank 0]: error: allreduce #0 (sum, 262144 bytes) on rank 0 of 2 (mpi) "
                          "failed: timed out after 3000 ms"),
            std::string::npos)
      << r.output;
}

TEST(BadInput, LauncherArguments) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  std::vector<Case> cases{
      {{"--nproc-per-node", "0", "--", "/bin/true"},
       "--nproc-per-node must be at least 1, or auto, cpu or gpu; got 0"},
      {{"--devices", "0,0", "--", "/bin/true"}, "--devices '0,0' lists GPU 0 twice"},
      {{"--devices", "0,gpu1", "--", "/bin/true"}, "'gpu1' is not a GPU index"},
      {{"--nproc-per-node", "2", "--", "/no/such/program"}, "program '/no/such/program' not found"},
      {{"--nproc-per-node", "2", "--", "no-such-program-on-path"},
       "program 'no-such-program-on-path' not found"},
      {{"--nnodes", "2", "--", "/bin/true"}, "--nnodes 2 needs --master-addr"},
      {{"--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "--", "/bin/true"},
       "--node-rank 2 is out of range for --nnodes 2"},
      {{"--nproc-per-node", "two", "--", "/bin/true"},
       "--nproc-per-node must be at least 1, or auto, cpu or gpu; got two"},
      {{"--bogus", "--", "/bin/true"}, "unknown option --bogus"},
      {{"--nproc-per-node", "2"}, "no program given"},
      {{"--backend", "smoke-signals", "--", "/bin/true"},
       "--backend: unknown backend 'smoke-signals'"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv{cli_path(), "launch"};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    auto r = run_cli(argv);
    EXPECT_NE(r.exit_code, 0) << c.message;
    EXPECT_NE(r.output.find(c.message), std::string::npos)
        << "expected '" << c.message << "' in: " << r.output;
    EXPECT_EQ(count_lines(r.output), 1) << r.output;
  }
}

}  // namespace
}  // namespace testing
}  // namespace paratrain

namespace paratrain {
namespace testing {
namespace {

// Point-to-point tags from 2^30 on carry paratrain's own collectives (gloo's reduce_scatter and
// allgather): a program's send or recv with one is refused before it could meet theirs.
TEST(BadInput, ReservedPointToPointTag) {
  const std::string path = "/tmp/" + unique_token("paratrain-tag-store");
  auto pg = dist::init_process_group(
      dist::InitOptions().backend("gloo").init_method("file://" + path).rank(0).world_size(1));
  at::Tensor t = torch::zeros({4});
  for (int tag : {-1, dist::ProcessGroup::kMaxUserTag}) {
    const std::string send = error_of([&] { pg->send(t, 0, tag); });
    EXPECT_NE(send.find("gloo send: tag must be in [0, 1073741824), got " + std::to_string(tag)),
              std::string::npos)
        << send;
    const std::string recv = error_of([&] { pg->recv(t, 0, tag); });
    EXPECT_NE(recv.find("gloo recv: tag must be in [0, 1073741824), got " + std::to_string(tag)),
              std::string::npos)
        << recv;
  }
}

// new_group's rank list, checked before any backend work (a world of one, in this process).
TEST(BadInput, NewGroupRanks) {
  const std::string path = "/tmp/" + unique_token("paratrain-newgroup-store");
  auto pg = dist::init_process_group(
      dist::InitOptions().backend("gloo").init_method("file://" + path).rank(0).world_size(1));
  auto error_of = [&](const std::vector<int>& ranks) -> std::string {
    try {
      pg->new_group(ranks);
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "";
  };
  EXPECT_NE(error_of({}).find("gloo new_group: the rank list is empty"), std::string::npos);
  EXPECT_NE(error_of({1}).find("gloo new_group: rank 1 is out of range for a group of size 1"),
            std::string::npos);
  EXPECT_NE(error_of({0, 0}).find("gloo new_group: rank 0 appears twice in [0, 0]"),
            std::string::npos);
  auto sub = pg->new_group({0});
  ASSERT_NE(sub, nullptr);
  at::Tensor t = torch::ones({3});
  sub->allreduce(t)->wait();
  EXPECT_EQ(t.sum().item<double>(), 3.0);
  std::remove(path.c_str());
}

// A write to a peer that has gone must come back as an error the collective reports (as under
// Python, which ignores SIGPIPE), not as SIGPIPE killing the rank. BadInput.PeerDiesMidCollective
// shows the whole path, but whether the peer's sockets are closed before or after rank 0 writes
// depends on timing; this checks the disposition itself, in this process.
TEST(BadInput, BrokenPipeIsAnErrorNotASignal) {
  auto disposition = [] {
    struct sigaction now {};
    EXPECT_EQ(sigaction(SIGPIPE, nullptr, &now), 0);
    return now.sa_handler;
  };
  const std::string path = "/tmp/" + unique_token("paratrain-sigpipe-store");
  auto init = [&] {
    return dist::init_process_group(
        dist::InitOptions().backend("gloo").init_method("file://" + path).rank(0).world_size(1));
  };
  struct sigaction original {};
  ASSERT_EQ(sigaction(SIGPIPE, nullptr, &original), 0);
  std::signal(SIGPIPE, SIG_DFL);
  auto pg = init();
  EXPECT_EQ(disposition(), SIG_IGN);
  pg.reset();
  std::remove(path.c_str());

  // A program's own handler stays.
  void (*mine)(int) = [](int) {};
  std::signal(SIGPIPE, mine);
  pg = init();
  EXPECT_EQ(disposition(), mine);
  pg.reset();
  std::remove(path.c_str());
  sigaction(SIGPIPE, &original, nullptr);
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
