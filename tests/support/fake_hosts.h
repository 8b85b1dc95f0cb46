#pragma once

// Hosts for multi-host tests and benchmarks on one machine: Linux network namespaces joined by
// veth pairs on a bridge that lives in a namespace of its own, so no address or route touches
// the machine's own network. Host k has eth0 = 10.77.0.(k+1)/24 and its own loopback. Shared by
// `paratrain bench cluster` and the tests (compiled into both).

#include <map>
#include <string>
#include <vector>

namespace paratrain {
namespace cli {

class FakeHosts {
 public:
  /// Why hosts cannot be made here ("" when they can): they need root and iproute2's `ip`.
  static std::string unavailable_reason();

  /// Makes `n` hosts; throws std::runtime_error naming the command that failed (after removing
  /// what it made).
  explicit FakeHosts(int n);
  ~FakeHosts();  // removes every namespace (and with them the veths and the bridge)
  FakeHosts(const FakeHosts&) = delete;
  FakeHosts& operator=(const FakeHosts&) = delete;

  int size() const { return n_; }
  /// "10.77.0.(k+1)".
  std::string address(int k) const;
  /// The namespace of host k.
  std::string netns(int k) const;
  /// `argv` run inside host k: {"ip", "netns", "exec", netns(k), argv...}.
  std::vector<std::string> exec(int k, const std::vector<std::string>& argv) const;
  /// An Open MPI host file listing every host with `slots` slots (removed with the hosts).
  std::string write_hostfile(int slots) const;
  /// An rsh agent for Open MPI (OMPI_MCA_plm_rsh_agent): `agent HOST COMMAND...` runs COMMAND in
  /// HOST's namespace, where ssh would log in, under the host name fakehostK and with a /dev/shm
  /// of its own, as on a real host (removed with the hosts).
  std::string write_rsh_agent() const;
  /// The environment mpirun needs on these hosts: the agent (for Open MPI 4 and 5), and TCP on
  /// eth0 between ranks (btl self,tcp: host 0's own ranks share the machine's /dev/shm with
  /// processes started outside the agent, so no shared-memory pairing is left to chance).
  std::map<std::string, std::string> mpirun_env() const;
  /// Cuts host k off the others (its eth0 down: a network partition; its address stays) or
  /// connects it again. Throws like the constructor.
  void set_link(int k, bool up);
  /// Adds `delay_ms` of latency (netem) to every packet host k sends; for benchmarks that model
  /// a slower link. Throws like the constructor.
  void set_delay(int k, double delay_ms);

 private:
  void remove();
  std::string tag_;
  int n_ = 0;
};

}  // namespace cli
}  // namespace paratrain
