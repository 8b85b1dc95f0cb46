// Slurm, for real: each test starts Debian's munged, slurmctld and slurmd on this machine with a
// temporary configuration (one node, this host), submits sbatch scripts, and checks what the jobs
// printed. Needs root and the slurm packages (scripts/setup.sh); without them the tests skip and
// say why.

#include "paratrain/launch/slurm.h"
#include "fake_hosts.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <thread>

namespace paratrain {
namespace testing {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

class SlurmCluster {
 public:
  static std::string unavailable_reason() {
    if (geteuid() != 0) {
      return "the test Slurm runs its daemons as root (this process runs as uid " +
             std::to_string(geteuid()) + ")";
    }
    for (const char* program : {"/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged",
                                "/usr/bin/sbatch", "/usr/bin/srun", "/usr/bin/sinfo"}) {
      if (::access(program, X_OK) != 0) {
        return std::string(program) +
               " is missing (Debian's slurmctld, slurmd, slurm-client and "
               "munge; scripts/setup.sh installs them)";
      }
    }
    return "";
  }

  /// One node, this host; or, with `hosts`, one node per namespace host (fakehostK at its
  /// address), each slurmd in its host's network namespace with the host names in an /etc/hosts
  /// of its own, and slurmctld on host 0.
  explicit SlurmCluster(const cli::FakeHosts* hosts = nullptr) : hosts_(hosts) {
    dir_ = "/tmp/" + unique_token("paratrain-slurm");
    ::mkdir(dir_.c_str(), 0755);
    for (const char* sub : {"/state", "/spool"}) {
      ::mkdir((dir_ + sub).c_str(), 0755);
    }
    start_munge();
    char name[256] = {0};
    ::gethostname(name, sizeof(name) - 1);
    std::string host = name;
    host = host.substr(0, host.find('.'));
    conf_ = dir_ + "/slurm.conf";
    // Slurm 23.11 and later (Debian 13's 24.11) start the cgroup plugin even with
    // proctrack/linuxproc, and fail where no cgroup filesystem is mounted (a chroot);
    // "CgroupPlugin=disabled" turns it off. 22.05 (Debian 12's) knows no such value.
    const std::string version = run_process({"/usr/sbin/slurmd", "-V"}, {}, 10).output;
    const size_t digits = version.find_first_of("0123456789");
    if (digits != std::string::npos && std::atoi(version.c_str() + digits) >= 23) {
      std::ofstream(dir_ + "/cgroup.conf") << "CgroupPlugin=disabled\n";
    }
    write_conf(host);
    env_ = {{"SLURM_CONF", conf_}};
    must(on_host(0, {"/usr/sbin/slurmctld", "-f", conf_}));
    for (int k = 0; k < (hosts_ ? hosts_->size() : 1); ++k) {
      must(on_host(k, {"/usr/sbin/slurmd", "-f", conf_}));
    }
    for (int i = 0; i < 300; ++i) {  // the nodes turn idle within seconds
      auto r = run_process(client({"/usr/bin/sinfo", "-h", "-o", "%t"}), env_, 10);
      if (r.output == "idle\n") {
        ready_ = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }

  ~SlurmCluster() {
    std::vector<std::string> pid_files{"/slurmctld.pid", "/slurmd.pid"};
    for (int k = 0; hosts_ != nullptr && k < hosts_->size(); ++k) {
      pid_files.push_back("/slurmd-fakehost" + std::to_string(k) + ".pid");
    }
    for (const auto& pid_file : pid_files) {
      const int pid = std::atoi(read_file(dir_ + pid_file).c_str());
      if (pid > 0) {
        ::kill(pid, SIGTERM);
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    if (munged_pid_ > 0) {
      ::kill(munged_pid_, SIGTERM);
    }
    remove_tree(dir_);
  }

  bool ready() const { return ready_; }
  std::string logs() const {
    std::string all = read_file(dir_ + "/slurmctld.log") + read_file(dir_ + "/slurmd.log");
    for (int k = 0; hosts_ != nullptr && k < hosts_->size(); ++k) {
      all += read_file(dir_ + "/slurmd-fakehost" + std::to_string(k) + ".log");
    }
    return all;
  }
  const std::string& dir() const { return dir_; }

  /// Submits `script` with sbatch --wait; returns sbatch's result, with the job's output appended.
  ProcessResult batch(const std::string& script) {
    const std::string path = dir_ + "/job-" + std::to_string(jobs_++) + ".sh";
    std::ofstream(path) << script;
    const std::string out = path + ".out";
    auto r = run_process(client({"/usr/bin/sbatch", "--wait", "-o", out, path}), env_, 300);
    r.output += read_file(out);
    return r;
  }

 private:
  void must(const std::vector<std::string>& argv) {
    auto r = run_process(argv, env_, 30);
    ASSERT_EQ(r.exit_code, 0) << argv[0] << ": " << r.output;
  }

  // munged, unless one already answers; the package made /etc/munge/munge.key.
  void start_munge() {
    if (run_process({"/bin/sh", "-c", "munge -n | unmunge"}, {}, 10).exit_code == 0) {
      return;
    }
    ::mkdir("/run/munge", 0755);
    run_process({"/bin/chown", "munge:munge", "/run/munge"}, {}, 10);
    must({"/usr/sbin/runuser", "-u", "munge", "--", "/usr/sbin/munged"});
    munged_pid_ = std::atoi(read_file("/run/munge/munged.pid").c_str());
  }

  void write_conf(const std::string& host) {
    const unsigned cpus = std::max(2u, std::thread::hardware_concurrency());
    std::ofstream conf(conf_);
    const std::string node = hosts_ ? "%n" : "";  // a file of each slurmd's own
    conf << "ClusterName=paratrain\n"
         << "SlurmctldHost="
         << (hosts_ ? "fakehost0(" + hosts_->address(0) + ")" : host + "(127.0.0.1)") << "\n"
         << "SlurmUser=root\nSlurmdUser=root\nAuthType=auth/munge\n"
         << "StateSaveLocation=" << dir_ << "/state\n"
         << "SlurmdSpoolDir=" << dir_ << "/spool" << node << "\n"
         << "SlurmctldPidFile=" << dir_ << "/slurmctld.pid\n"
         << "SlurmdPidFile=" << dir_ << "/slurmd" << (hosts_ ? "-%n" : "") << ".pid\n"
         << "SlurmctldLogFile=" << dir_ << "/slurmctld.log\n"
         << "SlurmdLogFile=" << dir_ << "/slurmd" << (hosts_ ? "-%n" : "") << ".log\n"
         << "SlurmctldPort=" << free_port() << "\nSlurmdPort=" << free_port()
         << "\nProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
         << "SchedulerType=sched/backfill\nSelectType=select/cons_tres\n"
         << "SelectTypeParameters=CR_Core\nReturnToService=2\nMpiDefault=none\n"
         << "JobAcctGatherType=jobacct_gather/none\n";
    if (hosts_ == nullptr) {
      conf << "NodeName=" << host << " NodeAddr=127.0.0.1 CPUs=" << cpus
           << " RealMemory=2000 State=UNKNOWN\n"
           << "PartitionName=debug Nodes=" << host
           << " Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES\n";
      return;
    }
    std::ofstream etc_hosts(dir_ + "/hosts");
    etc_hosts << "127.0.0.1 localhost\n";
    for (int k = 0; k < hosts_->size(); ++k) {
      const std::string name = "fakehost" + std::to_string(k);
      ::mkdir((dir_ + "/spool" + name).c_str(), 0755);
      etc_hosts << hosts_->address(k) << " " << name << "\n";
      conf << "NodeName=" << name << " NodeAddr=" << hosts_->address(k) << " CPUs=" << cpus
           << " RealMemory=2000 State=UNKNOWN\n";
    }
    conf << "PartitionName=debug Nodes=fakehost[0-" << hosts_->size() - 1
         << "] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES\n";
  }

  // A daemon of host k: in its network namespace, with its host name and the hosts' names in an
  // /etc/hosts of its own (a mount namespace, which its jobs' tasks inherit). nsenter rather than
  // `ip netns exec`, which mounts a /sys of its own, without the cgroup file systems slurmd needs.
  std::vector<std::string> on_host(int k, const std::vector<std::string>& argv) const {
    if (hosts_ == nullptr) {
      return argv;
    }
    std::vector<std::string> out{"/usr/bin/nsenter",
                                 "--net=/run/netns/" + hosts_->netns(k),
                                 "/usr/bin/unshare",
                                 "--uts",
                                 "--mount",
                                 "--propagation",
                                 "private",
                                 "/bin/sh",
                                 "-c",
                                 "mount --bind " + dir_ + "/hosts /etc/hosts && hostname fakehost" +
                                     std::to_string(k) + " && exec \"$0\" \"$@\""};
    out.insert(out.end(), argv.begin(), argv.end());
    return out;
  }

  // A client command (sinfo, sbatch): on host 0's network, where slurmctld listens.
  std::vector<std::string> client(const std::vector<std::string>& argv) const {
    if (hosts_ == nullptr) {
      return argv;
    }
    std::vector<std::string> out{"/usr/bin/nsenter", "--net=/run/netns/" + hosts_->netns(0)};
    out.insert(out.end(), argv.begin(), argv.end());
    return out;
  }

  const cli::FakeHosts* hosts_ = nullptr;
  std::string dir_, conf_;
  std::map<std::string, std::string> env_;
  bool ready_ = false;
  int munged_pid_ = -1;
  int jobs_ = 0;
};

#define SKIP_WITHOUT_SLURM()                                    \
  do {                                                          \
    const std::string why = SlurmCluster::unavailable_reason(); \
    if (!why.empty()) {                                         \
      GTEST_SKIP() << why;                                      \
    }                                                           \
  } while (0)

// docs/several-hosts.md's multi-node form on a real allocation of two nodes: a Slurm of two slurmd
// on two namespace hosts (in this test, which owns munged while it runs). srun starts one launcher
// per node, each finds its place in the allocation, and DDP across them equals one process.
void two_node_allocation() {
  const std::string why = cli::FakeHosts::unavailable_reason();
  if (!why.empty() || ::access("/usr/bin/nsenter", X_OK) != 0 ||
      ::access("/usr/bin/unshare", X_OK) != 0) {
    std::cout << "two-node allocation left out: "
              << (why.empty() ? "nsenter or unshare (util-linux) is missing" : why) << std::endl;
    return;
  }
  cli::FakeHosts hosts(2);
  SlurmCluster slurm(&hosts);
  ASSERT_TRUE(slurm.ready()) << slurm.logs();
  auto r = slurm.batch(
      "#!/bin/sh\n#SBATCH --nodes 2\n#SBATCH --ntasks-per-node 1\n"
      "#SBATCH --time 10\nexport PARATRAIN_TIMEOUT=60\n"
      "srun --ntasks-per-node 1 " +
      cli_path() + " launch --nproc-per-node 2 -- " + PARATRAIN_TEST_DDP_WORKER + "\n");
  EXPECT_EQ(r.exit_code, 0) << r.output << slurm.logs();
  for (int k = 0; k < 2; ++k) {
    EXPECT_NE(r.output.find(": node " + std::to_string(k) + " of 2 (fakehost" + std::to_string(k) +
                            "), node 0 fakehost0"),
              std::string::npos)
        << r.output;
  }
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_NE(r.output.find("rank " + std::to_string(rank) + ": ok"), std::string::npos)
        << r.output;
  }
}

// docs/several-hosts.md's sbatch examples, as they are there. One test, one Slurm: the tests run
// two at a time, and two test Slurms would share (and stop) one munged.
TEST(Slurm, SbatchRunsSrunTasksAndLaunch) {  // ctest: slow 35
  SKIP_WITHOUT_SLURM();
  SlurmCluster slurm;
  ASSERT_TRUE(slurm.ready()) << slurm.logs();
  const std::string weights = slurm.dir() + "/weights.safetensors";
  auto r = slurm.batch(
      "#!/bin/sh\n#SBATCH --ntasks 2\n#SBATCH --time 10\n"
      "export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\n"
      "export MASTER_PORT=" +
      std::to_string(free_port()) +
      "\n"
      "srun --ntasks 2 " +
      cli_path() +
      " train --strategy ddp --model linear --epochs 1 --steps 5 --batch-size 32"
      " --json --save-weights " +
      weights + "\n");
  EXPECT_EQ(r.exit_code, 0) << r.output << slurm.logs();
  EXPECT_NE(r.output.find("{\"epoch\": 1, "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("strategy ddp, 2 ranks (gloo)"), std::string::npos) << r.output;
  struct stat st;
  EXPECT_EQ(::stat(weights.c_str(), &st), 0) << r.output;

  // docs/several-hosts.md's multi-node form, on this one node: launch reads the allocation (node 0
  // of 1).
  r = slurm.batch(
      "#!/bin/sh\n#SBATCH --nodes 1\n#SBATCH --ntasks-per-node 1\n#SBATCH --time 10\n"
      "srun --ntasks-per-node 1 " +
      cli_path() + " launch --nproc-per-node 2 --master-port " + std::to_string(free_port()) +
      " -- " + PARATRAIN_TEST_DDP_WORKER + "\n");
  EXPECT_EQ(r.exit_code, 0) << r.output << slurm.logs();
  EXPECT_NE(r.output.find(": node 0 of 1 ("), std::string::npos) << r.output;
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(r.output.find("rank " + std::to_string(rank) + ": ok"), std::string::npos)
        << r.output;
  }

  // paratrain launch inside the allocation.
  r = slurm.batch("#!/bin/sh\n#SBATCH --ntasks 2\n#SBATCH --time 10\n" + cli_path() +
                  " launch --standalone --nproc-per-node 2 -- " + PARATRAIN_TEST_DDP_WORKER + "\n");
  EXPECT_EQ(r.exit_code, 0) << r.output << slurm.logs();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(r.output.find("rank " + std::to_string(rank) + ": ok"), std::string::npos)
        << r.output;
  }
  two_node_allocation();
}

// Slurm's host lists, expanded as `scontrol show hostnames` expands them (it needs a slurm.conf,
// any will do: it reads no node from it).
TEST(SlurmHostList, ExpandsAsScontrolDoes) {
  if (::access("/usr/bin/scontrol", X_OK) != 0) {
    GTEST_SKIP() << "/usr/bin/scontrol is missing (Debian's slurm-client; scripts/setup.sh "
                    "installs it)";
  }
  const std::string conf = "/tmp/" + unique_token("paratrain-hostlist") + ".conf";
  std::ofstream(conf) << "ClusterName=x\nSlurmctldHost=localhost\nNodeName=localhost\n"
                         "PartitionName=p Nodes=localhost\n";
  for (const std::string list :
       {"node[01-04,07]", "node[01-04,07],gpu1", "10.77.0.[1-2]", "a[1-2]b[3-4]", "a[1-2]b[5,3]",
        "n[9-11],n[009-011]", "n[01-3]", "n[1-03]", "x,y z", "n[1-2][3]", "solo"}) {
    auto r =
        run_process({"/usr/bin/scontrol", "show", "hostnames", list}, {{"SLURM_CONF", conf}}, 30);
    ASSERT_EQ(r.exit_code, 0) << list << ": " << r.output;
    std::string ours;
    for (const auto& h : dist::expand_hostlist(list)) {
      ours += h + "\n";
    }
    EXPECT_EQ(ours, r.output) << list;
  }
  std::remove(conf.c_str());
}

TEST(SlurmHostList, BadListsAreOneLine) {
  const std::vector<std::pair<std::string, std::string>> cases{
      {"node[01-", "node list 'node[01-' opens a bracket it never closes"},
      {"node[3-1]", "node list 'node[3-1]': the range '3-1' runs backwards"},
      {"node[1-2]]", "node list 'node[1-2]]' has a ']' without its '['"},
      {"n[a-b]", "node list 'n[a-b]': '[a-b]' is not a range"},
      {"n[1,,2]", "node list 'n[1,,2]': '[]' is not a range"},
      {"n[1-2]x", "node list 'n[1-2]x': 'n[1-2]x' has text after its last bracket group"},
      {"n[[1]]", "node list 'n[[1]]' has a bracket inside a bracket"},
      {",", "node list ',' names no host"},
      {"n[1-99999999]", "names more than"},
  };
  for (const auto& [list, message] : cases) {
    const std::string error = error_of([&] { dist::expand_hostlist(list); });
    EXPECT_NE(error.find(message), std::string::npos) << list << ": " << error;
  }
}

// srun's variables: the step's node list and node count, and the node's index among them.
TEST(SlurmHostList, PlacementFromTheAllocationsVariables) {
  EXPECT_FALSE(dist::slurm_placement({{"SLURM_NODEID", "1"}}).has_value());
  auto p = dist::slurm_placement({{"SLURM_JOB_ID", "42"},
                                  {"SLURM_JOB_NODELIST", "gpu[07-09]"},
                                  {"SLURM_STEP_NODELIST", "gpu[07-09]"},
                                  {"SLURM_NNODES", "3"},
                                  {"SLURM_NODEID", "2"}});
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->nnodes, 3);
  EXPECT_EQ(p->node_rank, 2);
  EXPECT_EQ(p->master_addr, "gpu07");
  EXPECT_EQ(p->hosts.back(), "gpu09");
  // srun -N2 -w n[3-4] in an allocation of four nodes: the step's nodes.
  p = dist::slurm_placement({{"SLURM_JOB_ID", "43"},
                             {"SLURM_JOB_NODELIST", "n[1-4]"},
                             {"SLURM_JOB_NUM_NODES", "4"},
                             {"SLURM_STEP_NODELIST", "n[3-4]"},
                             {"SLURM_STEP_NUM_NODES", "2"},
                             {"SLURM_NNODES", "4"},
                             {"SLURM_NODEID", "1"}});
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->nnodes, 2);
  EXPECT_EQ(p->node_rank, 1);
  EXPECT_EQ(p->master_addr, "n3");
  EXPECT_EQ(p->hosts[1], "n4");
  // A batch script of a one-node allocation (no srun): node 0 of 1.
  p = dist::slurm_placement({{"SLURM_JOB_ID", "44"}, {"SLURM_JOB_NODELIST", "solo"}});
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->nnodes, 1);
  EXPECT_EQ(p->node_rank, 0);
  const std::vector<std::pair<std::map<std::string, std::string>, std::string>> bad{
      {{{"SLURM_JOB_ID", "1"}, {"SLURM_JOB_NODELIST", "a[1-2"}},
       "SLURM_JOB_NODELIST: node list 'a[1-2' opens a bracket it never closes; give --nnodes, "
       "--node-rank and --master-addr instead"},
      {{{"SLURM_JOB_ID", "1"}, {"SLURM_STEP_NODELIST", "a[1-2]"}, {"SLURM_NODEID", "2"}},
       "SLURM_NODEID=2 is beyond SLURM_STEP_NODELIST 'a[1-2]' (2 hosts)"},
      {{{"SLURM_JOB_ID", "1"}, {"SLURM_STEP_NODELIST", "a[1-2]"}, {"SLURM_NNODES", "3"}},
       "SLURM_NNODES=3 but SLURM_STEP_NODELIST 'a[1-2]' names 2 hosts"},
      {{{"SLURM_JOB_ID", "1"}}, "SLURM_JOB_ID is set (1) but SLURM_JOB_NODELIST is not"},
      {{{"SLURM_JOB_ID", "1"}, {"SLURM_JOB_NODELIST", "a"}, {"SLURM_NODEID", "x"}},
       "SLURM_NODEID='x' is not a number"},
      {{{"SLURM_JOB_ID", "1"}, {"SLURM_JOB_NODELIST", "a[1-2]"}, {"SLURM_NNODES", "2"}},
       "the Slurm allocation has 2 nodes, but this is not an srun step: start one paratrain "
       "launch per node with srun --ntasks-per-node 1, or give --nnodes 1"},
      // A step list of another job's nodes (inherited by a batch script submitted from a step).
      {{{"SLURM_JOB_ID", "1"},
        {"SLURM_JOB_NODELIST", "a[1-2]"},
        {"SLURM_STEP_NODELIST", "b[1-2]"},
        {"SLURM_NODEID", "1"}},
       "the Slurm allocation has 2 nodes, but this is not an srun step"},
      {{{"SLURM_JOB_ID", "1"},
        {"SLURM_STEP_NODELIST", "a"},
        {"SLURM_STEP_NUM_TASKS", "2"},
        {"SLURM_STEP_NUM_NODES", "1"}},
       "srun started 2 tasks on 1 node: paratrain launch starts a node's workers itself; run one "
       "per node (srun --ntasks-per-node 1)"},
  };
  for (const auto& [env, message] : bad) {
    const std::string error = error_of([&] { dist::slurm_placement(env); });
    EXPECT_NE(error.find(message), std::string::npos) << message << ": " << error;
  }
}

// The CLI says the same in one line and exits non-zero, before starting anything.
TEST(SlurmHostList, LaunchRefusesABadAllocation) {
  const std::vector<std::pair<std::map<std::string, std::string>, std::string>> cases{
      {{{"SLURM_NODEID", "3"}, {"SLURM_NNODES", "3"}, {"SLURM_STEP_NODELIST", "node[1-2],node3"}},
       "SLURM_NODEID=3 is beyond SLURM_STEP_NODELIST 'node[1-2],node3' (3 hosts)"},
      {{{"SLURM_NODEID", "0"}, {"SLURM_JOB_NODELIST", "node[1-2"}},
       "SLURM_JOB_NODELIST: node list 'node[1-2' opens a bracket it never closes"},
  };
  for (auto [env, message] : cases) {
    env["SLURM_JOB_ID"] = "5";
    auto r =
        run_process({cli_path(), "launch", "--nproc-per-node", "1", "--", "/bin/true"}, env, 60);
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("paratrain launch: error: " + message), std::string::npos) << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  }
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
