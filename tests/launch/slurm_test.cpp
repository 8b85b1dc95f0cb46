// Slurm, for real: each test starts Debian's munged, slurmctld and slurmd on this machine with a
// temporary configuration (one node, this host), submits sbatch scripts, and checks what the jobs
// printed. Needs root and the slurm packages (scripts/setup.sh); without them the tests skip and
// say why.

#include "test_util.h"

#include <gtest/gtest.h>

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
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

  SlurmCluster() {
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
    const unsigned cpus = std::max(2u, std::thread::hardware_concurrency());
    std::ofstream(conf_) << "ClusterName=paratrain\n"
                         << "SlurmctldHost=" << host << "(127.0.0.1)\n"
                         << "SlurmUser=root\nSlurmdUser=root\nAuthType=auth/munge\n"
                         << "StateSaveLocation=" << dir_ << "/state\n"
                         << "SlurmdSpoolDir=" << dir_ << "/spool\n"
                         << "SlurmctldPidFile=" << dir_ << "/slurmctld.pid\n"
                         << "SlurmdPidFile=" << dir_ << "/slurmd.pid\n"
                         << "SlurmctldLogFile=" << dir_ << "/slurmctld.log\n"
                         << "SlurmdLogFile=" << dir_ << "/slurmd.log\n"
                         << "SlurmctldPort=" << free_port() << "\nSlurmdPort=" << free_port()
                         << "\nProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
                         << "SchedulerType=sched/backfill\nSelectType=select/cons_tres\n"
                         << "SelectTypeParameters=CR_Core\nReturnToService=2\nMpiDefault=none\n"
                         << "JobAcctGatherType=jobacct_gather/none\n"
                         << "NodeName=" << host << " NodeAddr=127.0.0.1 CPUs=" << cpus
                         << " RealMemory=2000 State=UNKNOWN\n"
                         << "PartitionName=debug Nodes=" << host
                         << " Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES\n";
    env_ = {{"SLURM_CONF", conf_}};
    must({"/usr/sbin/slurmctld", "-f", conf_});
    must({"/usr/sbin/slurmd", "-f", conf_});
    for (int i = 0; i < 300; ++i) {  // the node turns idle within seconds
      auto r = run_process({"/usr/bin/sinfo", "-h", "-o", "%t"}, env_, 10);
      if (r.output.find("idle") != std::string::npos) {
        ready_ = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }

  ~SlurmCluster() {
    for (const char* pid_file : {"/slurmd.pid", "/slurmctld.pid"}) {
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
    return read_file(dir_ + "/slurmctld.log") + read_file(dir_ + "/slurmd.log");
  }
  const std::string& dir() const { return dir_; }

  /// Submits `script` with sbatch --wait; returns sbatch's result, with the job's output appended.
  ProcessResult batch(const std::string& script) {
    const std::string path = dir_ + "/job-" + std::to_string(jobs_++) + ".sh";
    std::ofstream(path) << script;
    const std::string out = path + ".out";
    auto r = run_process({"/usr/bin/sbatch", "--wait", "-o", out, path}, env_, 300);
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

// The README's sbatch examples, as they are there. One test, one Slurm: the tests run two at a
// time, and two test Slurms would share (and stop) one munged.
TEST(Slurm, SbatchRunsSrunTasksAndLaunch) {
  SKIP_WITHOUT_SLURM();
  SlurmCluster slurm;
  ASSERT_TRUE(slurm.ready()) << slurm.logs();
  const std::string weights = slurm.dir() + "/weights.safetensors";
  auto r = slurm.batch(
      "#!/bin/sh\n#SBATCH --ntasks 2\n#SBATCH --time 10\n"
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

  // paratrain launch inside the allocation.
  r = slurm.batch("#!/bin/sh\n#SBATCH --ntasks 2\n#SBATCH --time 10\n" + cli_path() +
                  " launch --standalone --nproc-per-node 2 -- " + PARATRAIN_TEST_DDP_WORKER + "\n");
  EXPECT_EQ(r.exit_code, 0) << r.output << slurm.logs();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(r.output.find("rank " + std::to_string(rank) + ": ok"), std::string::npos)
        << r.output;
  }
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
