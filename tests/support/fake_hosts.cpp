#include "fake_hosts.h"

#include "paratrain/launch/launch.h"  // find_program

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>

namespace paratrain {
namespace cli {
namespace {

// Runs a shell command made only of names this file generates; returns its exit status and
// output.
int shell(const std::string& command, std::string* output) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) {
    return -1;
  }
  char buffer[512];
  while (fgets(buffer, sizeof(buffer), pipe) != nullptr) {
    if (output != nullptr) {
      *output += buffer;
    }
  }
  int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

void must(const std::string& command) {
  std::string output;
  if (shell(command, &output) != 0) {
    throw std::runtime_error("fake hosts: `" + command + "` failed: " + output);
  }
}

}  // namespace

std::string FakeHosts::unavailable_reason() {
  if (geteuid() != 0) {
    return "network namespaces need root (this process runs as uid " + std::to_string(geteuid()) +
           ")";
  }
  if (shell("ip netns list", nullptr) != 0) {
    return "iproute2's `ip netns` does not work here";
  }
  return "";
}

FakeHosts::FakeHosts(int n) : n_(n) {
  static std::atomic<int> counter{0};
  // Short: interface names hold 15 characters ("p" + tag + host + side).
  tag_ = std::to_string(getpid() % 100000) + std::to_string(counter++ % 10);
  try {
    must("ip netns add ptsw" + tag_);
    const std::string sw = "ip netns exec ptsw" + tag_ + " ";
    must(sw + "ip link add br0 type bridge");
    must(sw + "ip link set br0 up");
    for (int k = 0; k < n; ++k) {
      const std::string host = netns(k);
      const std::string a = "p" + tag_ + std::to_string(k) + "a";
      const std::string b = "p" + tag_ + std::to_string(k) + "b";
      must("ip netns add " + host);
      must("ip link add " + a + " type veth peer name " + b);
      must("ip link set " + a + " netns " + host);
      must("ip link set " + b + " netns ptsw" + tag_);
      must(sw + "ip link set " + b + " master br0 up");
      const std::string in = "ip netns exec " + host + " ";
      must(in + "ip link set lo up");
      must(in + "ip link set " + a + " name eth0");
      must(in + "ip addr add " + address(k) + "/24 dev eth0");
      must(in + "ip link set eth0 up");
    }
  } catch (...) {
    remove();
    throw;
  }
}

FakeHosts::~FakeHosts() {
  remove();
}

std::string FakeHosts::write_hostfile(int slots) const {
  const std::string path = "/tmp/ptfh" + tag_ + ".hosts";
  std::ofstream out(path);
  for (int k = 0; k < n_; ++k) {
    out << address(k) << " slots=" << slots << "\n";
  }
  if (!out) {
    throw std::runtime_error("fake hosts: cannot write " + path);
  }
  return path;
}

std::string FakeHosts::write_rsh_agent() const {
  const std::string path = "/tmp/ptfh" + tag_ + "-rsh.sh";
  {
    std::ofstream out(path);
    // Like a login on a real host, the command gets the host's own host name and /dev/shm.
    // Without them Open MPI 5's hierarchical collectives (coll/han), which group ranks by node,
    // hung in the first allreduce of real size between these hosts.
    out << "#!/bin/sh\n# Open MPI's rsh agent for fake hosts: enter the host's namespace.\n"
        << "host=\"$1\"; shift\ncase \"$host\" in\n";
    for (int k = 0; k < n_; ++k) {
      out << "  " << address(k) << ") ns=" << netns(k) << "; name=fakehost" << k << " ;;\n";
    }
    out << "  *) echo \"rsh agent: no host $host\" >&2; exit 255 ;;\nesac\n"
        << "exec " << exec(0, {})[0]
        << " netns exec \"$ns\" unshare --uts --mount sh -c \"hostname $name && mount -t tmpfs "
           "tmpfs /dev/shm && $*\"\n";
    if (!out) {
      throw std::runtime_error("fake hosts: cannot write " + path);
    }
  }
  chmod(path.c_str(), 0755);
  return path;
}

std::map<std::string, std::string> FakeHosts::mpirun_env() const {
  const std::string agent = write_rsh_agent();
  // Open MPI 4 (Debian 12) reads the agent as plm_rsh_agent; Open MPI 5 (Debian 13) starts its
  // daemons through PRRTE, whose component is plm_ssh.
  return {{"OMPI_MCA_plm_rsh_agent", agent},
          {"PRTE_MCA_plm_ssh_agent", agent},
          // Where Open MPI finds InfiniBand or RoCE it may pick UCX, which ignores the btl list
          // below and could reach ranks in other namespaces of this machine through shared
          // memory: keep the test's traffic on TCP between the hosts.
          {"OMPI_MCA_pml", "ob1"},
          {"OMPI_MCA_btl", "self,tcp"},
          // Every host has a loopback of its own: a rank must not take a peer's 127.0.0.1 for a
          // route to it (Open MPI 5 pairs every interface it finds).
          {"OMPI_MCA_btl_tcp_if_include", "eth0"}};
}

void FakeHosts::remove() {
  std::remove(("/tmp/ptfh" + tag_ + ".hosts").c_str());
  std::remove(("/tmp/ptfh" + tag_ + "-rsh.sh").c_str());
  for (int k = 0; k < n_; ++k) {
    shell("ip netns del " + netns(k), nullptr);
  }
  shell("ip netns del ptsw" + tag_, nullptr);
}

std::string FakeHosts::address(int k) const {
  return "10.77.0." + std::to_string(k + 1);
}

std::string FakeHosts::netns(int k) const {
  return "pth" + tag_ + "-" + std::to_string(k);
}

std::vector<std::string> FakeHosts::exec(int k, const std::vector<std::string>& argv) const {
  // Absolute: callers start it with execve.
  const std::string ip = dist::find_program("ip");
  std::vector<std::string> out{ip.empty() ? "/usr/sbin/ip" : ip, "netns", "exec", netns(k)};
  out.insert(out.end(), argv.begin(), argv.end());
  return out;
}

void FakeHosts::set_link(int k, bool up) {
  must("ip netns exec " + netns(k) + " ip link set eth0 " + (up ? "up" : "down"));
}

void FakeHosts::set_delay(int k, double delay_ms) {
  must("ip netns exec " + netns(k) + " tc qdisc replace dev eth0 root netem delay " +
       std::to_string(delay_ms) + "ms");
}

}  // namespace cli
}  // namespace paratrain
